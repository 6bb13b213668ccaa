"""Crash safety: a real plugin process is SIGKILLed at every step of prepare and unprepare.

Each test kills a worker process (tests/kubeletplugin/crash_worker.py) at one step, either with
the simulator's kill-at-step faults (NVML calls) or with a kill right after a CDI or checkpoint
write, then starts a fresh process that retries the same operation, as the kubelet does. After
the retry: the operation succeeded, no MIG instance leaked, none was created twice, and the
checkpoint, NVML and the CDI directory agree.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.naming import mig_device_name
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import CheckpointStore, ClaimState
from tests.kubeletplugin.crash_worker import DRIVER, NODE, FileClaims, run_worker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# GPU 0 is a Hopper with MIG off (prepare enables it), GPU 1 an Ampere with MIG on.
GPUS = [{"model": "H100-SXM5-80GB", "mig": False}, {"model": "A100-SXM4-40GB"}]
DEVICES = [
    mig_device_name(0, "1g.10gb", 19, 3),
    mig_device_name(1, "3g.20gb", 9, 4),
]


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "sim.yaml"
        self.config.write_text(
            yaml.safe_dump({"state": str(root / "sim-state.json"), "gpus": GPUS})
        )
        sim.configure(self.config)
        self.claims = FileClaims(root / "claims.json")
        self.uid = str(uuid.uuid4())
        self.claims.put(
            {
                "metadata": {"namespace": "ns", "name": "claim", "uid": self.uid,
                             "resourceVersion": "1", "finalizers": []},
                "status": {"allocation": {"devices": {"results": [
                    {"request": f"r{i}", "driver": DRIVER, "pool": NODE, "device": d}
                    for i, d in enumerate(DEVICES)
                ]}}},
            }
        )  # fmt: skip

    def run(self, op: str, crash_at: str = "") -> subprocess.CompletedProcess[str]:
        return run_worker(self.config, self.root, op, self.uid, crash_at)

    def result(self, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out[self.uid]

    def live(self) -> list[tuple[str, int, int, int, int]]:
        """(gpu uuid, gi id, profile id, start, CI count) of every instance on the node."""
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            return sorted(
                (g.uuid, i.gi_id, i.profile_id, i.placement.start, len(i.compute_instances))
                for g in b.gpus()
                if b.mig_enabled(g.uuid)
                for i in b.instances(g.uuid)
            )

    def finalizers(self) -> list[str]:
        obj = self.claims.raw("ns", "claim")
        assert obj is not None
        return list(obj["metadata"].get("finalizers") or [])

    def check_prepared(self) -> None:
        cp = CheckpointStore(self.root / "checkpoint").load()
        rec = cp.claims[self.uid]
        assert rec.state is ClaimState.PREPARE_COMPLETED
        assert cp.foreign == ()
        recorded = sorted(
            (d.gpu_uuid, d.gi_id, d.profile_id, d.placement_start, 1) for d in rec.devices
        )
        assert self.live() == recorded  # exactly the claim's instances: no leak, no double
        assert [p.name for p in (self.root / "cdi").iterdir()] == [
            f"{DRIVER}-claim_{self.uid}.json"
        ]
        assert self.finalizers() == [f"{DRIVER}/node-{NODE}"]

    def check_unprepared(self) -> None:
        cp = CheckpointStore(self.root / "checkpoint").load()
        assert cp.claims == {} and cp.foreign == ()
        assert self.live() == []
        cdi = self.root / "cdi"
        assert not cdi.exists() or list(cdi.iterdir()) == []
        assert self.finalizers() == []


@pytest.fixture
def env(tmp_path: Path) -> Any:
    e = Env(tmp_path)
    yield e
    sim.configure(None)


PREPARE_STEPS = [
    "sim:before:DeviceSetMigMode",
    "sim:after:DeviceSetMigMode",
    "sim:before:CreateGpuInstanceWithPlacement",
    "sim:after:CreateGpuInstanceWithPlacement",
    "sim:before:GpuInstanceCreateComputeInstance",
    "sim:after:GpuInstanceCreateComputeInstance",
    "sim:after:CreateGpuInstanceWithPlacement@1",  # second device, first one done
    "sim:after:GpuInstanceCreateComputeInstance@1",
    "save:1",  # PrepareStarted written
    "finalizer-add",  # the apiserver has the node finalizer; the checkpoint does not know
    "save:2",  # finalizer recorded
    "save:3",  # first device recorded
    "save:4",  # second device recorded
    "cdi-write",
    "save:5",  # PrepareCompleted written (the reply is lost)
]

UNPREPARE_STEPS = [
    "save:1",  # UnprepareStarted written
    "sim:before:ComputeInstanceDestroy",
    "sim:after:ComputeInstanceDestroy",
    "sim:before:GpuInstanceDestroy",
    "sim:after:GpuInstanceDestroy",
    "save:2",  # first device cleared
    "sim:after:GpuInstanceDestroy@1",
    "save:3",  # second device cleared
    "cdi-remove",
    "finalizer-remove",  # the finalizer is gone; the record still says UnprepareStarted
    "save:4",  # record dropped
]


def _arm(env: Env, step: str) -> str:
    """Arm a simulator fault for `sim:` steps; return CRASH_AT for the others."""
    if not step.startswith("sim:"):
        return step
    point, _, gpu = step[4:].partition("@")
    sim.sim_crash_at(point, tag="worker", gpu=int(gpu) if gpu else None)
    return ""


@pytest.mark.parametrize("step", PREPARE_STEPS)
def test_kill_during_prepare_then_retry(env: Env, step: str) -> None:
    crashed = env.run("prepare", _arm(env, step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    retry = env.result(env.run("prepare"))
    assert retry["error"] == ""
    assert len(retry["cdi"]) == 2
    env.check_prepared()
    again = env.result(env.run("prepare"))  # another restart + retry changes nothing
    assert again == retry
    env.check_prepared()
    assert env.result(env.run("unprepare"))["error"] == ""
    env.check_unprepared()


@pytest.mark.parametrize("step", ["save:1", "finalizer-add", "save:2", "cdi-write"])
def test_kill_during_prepare_then_the_pod_is_deleted(env: Env, step: str) -> None:
    """Issue 32, point 3(a): the kubelet does not retry the prepare but unprepares (the pod
    was deleted meanwhile). The node finalizer goes even when the killed process never saved
    that it had added it; before, such a claim stayed Terminating for good."""
    crashed = env.run("prepare", _arm(env, step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    assert env.result(env.run("unprepare"))["error"] == ""
    env.check_unprepared()


@pytest.mark.parametrize("step", UNPREPARE_STEPS)
def test_kill_during_unprepare_then_retry(env: Env, step: str) -> None:
    assert env.result(env.run("prepare"))["error"] == ""
    env.check_prepared()
    crashed = env.run("unprepare", _arm(env, step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    assert env.result(env.run("unprepare"))["error"] == ""
    env.check_unprepared()
    # and the placements are usable again
    assert env.result(env.run("prepare"))["error"] == ""
    env.check_prepared()


@pytest.mark.parametrize(
    "recovery_step",
    ["sim:before:ComputeInstanceDestroy", "sim:before:GpuInstanceDestroy",
     "sim:after:GpuInstanceDestroy"],
)  # fmt: skip
def test_kill_during_start_up_recovery_then_retry(env: Env, recovery_step: str) -> None:
    """A second crash while the restarted agent rolls back the first one is recovered too."""
    _arm(env, "sim:after:GpuInstanceCreateComputeInstance@1")
    assert env.run("prepare").returncode == -9  # two instances carved, none recorded complete
    sim.sim_clear_faults()
    _arm(env, recovery_step)
    assert env.run("prepare").returncode == -9  # killed inside reconcile's rollback
    sim.sim_clear_faults()
    assert env.result(env.run("prepare"))["error"] == ""
    env.check_prepared()
