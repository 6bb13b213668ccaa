"""Crash safety of warm slices: a real plugin process is SIGKILLed at every step of keeping an
instance warm, taking one over, and reclaiming one, then a fresh process retries, as the
kubelet does. After the retry every instance on the node has exactly one checkpointed owner (a
claim or the warm pool), none is foreign, none leaked, none was handed out twice.
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
from kubeletplugin.checkpoint import Checkpoint, CheckpointStore, ClaimState
from tests.kubeletplugin.crash_worker import DRIVER, NODE, FileClaims, run_worker

pytestmark = pytest.mark.slow

DEVICE = mig_device_name(0, "1g.10gb", 19, 3)


class WarmEnv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "sim.yaml"
        self.config.write_text(
            yaml.safe_dump({"state": str(root / "sim-state.json"), "gpus": ["H100-SXM5-80GB"]})
        )
        sim.configure(self.config)
        self.claims = FileClaims(root / "claims.json")

    def claim(self, name: str, namespace: str = "ns") -> str:
        uid = str(uuid.uuid4())
        self.claims.put(
            {
                "metadata": {"namespace": namespace, "name": name, "uid": uid,
                             "resourceVersion": "1", "finalizers": []},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "r", "driver": DRIVER, "pool": NODE, "device": DEVICE}
                ]}}},
            }
        )  # fmt: skip
        return uid

    def run(self, op: str, uid: str, crash_at: str = "") -> subprocess.CompletedProcess[str]:
        return run_worker(self.config, self.root, op, uid, crash_at)

    def ok(self, op: str, uid: str) -> None:
        proc = self.run(op, uid)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out[uid]["error"] == ""

    def checkpoint(self) -> Checkpoint:
        return CheckpointStore(self.root / "checkpoint").load()

    def live(self) -> list[tuple[int, str | None]]:
        """(gi id, MIG UUID) of every instance on the node."""
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            return sorted(
                (i.gi_id, i.compute_instances[0].mig_uuid if i.compute_instances else None)
                for g in b.gpus()
                if b.mig_enabled(g.uuid)
                for i in b.instances(g.uuid)
            )

    def check_one_owner_each(self) -> None:
        cp = self.checkpoint()
        assert cp.foreign == ()
        owned = [
            (d.gi_id, d.mig_uuid)
            for r in cp.claims.values()
            for d in r.devices
            if d.gi_id is not None
        ]
        warm = [(w.gi_id, w.mig_uuid) for w in cp.warm]
        assert sorted(owned + warm) == self.live()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("WARM_TTL", "600")
    monkeypatch.setenv("WARM_SEED", "0:19")
    e = WarmEnv(tmp_path)
    yield e
    sim.configure(None)


def _arm(step: str) -> str:
    if not step.startswith("sim:"):
        return step
    sim.sim_crash_at(step[4:], tag="worker")
    return ""


def _park(env: WarmEnv) -> str:
    first = env.claim("first")
    env.ok("prepare", first)
    env.ok("unprepare", first)
    (warm,) = env.checkpoint().warm
    return warm.mig_uuid


PARK_STEPS = [
    "save:1",  # UnprepareStarted written
    "sim:before:DeviceGetComputeRunningProcesses",
    "save:2",  # the device cleared and the warm instance recorded, in one write
    "cdi-remove",
    "save:3",  # record dropped
]


@pytest.mark.parametrize("step", PARK_STEPS)
def test_kill_while_keeping_an_instance_warm_then_retry(env: WarmEnv, step: str) -> None:
    uid = env.claim("first")
    env.ok("prepare", uid)
    crashed = env.run("unprepare", uid, _arm(step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    env.ok("unprepare", uid)
    cp = env.checkpoint()
    assert cp.claims == {}
    assert list((env.root / "cdi").iterdir()) == []
    assert env.claims.raw("ns", "first")["metadata"]["finalizers"] == []
    env.check_one_owner_each()  # kept warm, or destroyed by the restart's rollback: never both
    assert len(env.live()) == len(cp.warm) <= 1


REUSE_STEPS = [
    "save:1",  # PrepareStarted written
    "save:2",  # finalizer recorded
    "sim:before:DeviceGetComputeRunningProcesses",
    "save:3",  # the instance moves from the warm pool to the claim, in one write
    "cdi-write",
    "save:4",  # PrepareCompleted written
]


@pytest.mark.parametrize("step", REUSE_STEPS)
def test_kill_while_taking_over_a_warm_instance_then_retry(env: WarmEnv, step: str) -> None:
    _park(env)
    second = env.claim("second")
    crashed = env.run("prepare", second, _arm(step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    env.ok("prepare", second)
    cp = env.checkpoint()
    assert cp.claims[second].state is ClaimState.PREPARE_COMPLETED
    env.check_one_owner_each()
    assert len(env.live()) == 1  # one instance at the placement, however it got there
    env.ok("unprepare", second)
    env.check_one_owner_each()


RECLAIM_STEPS = [
    "save:3",  # the warm instance marked Reclaiming
    "sim:before:ComputeInstanceDestroy",
    "sim:after:ComputeInstanceDestroy",  # half destroyed: a GI without its CI
    "sim:after:GpuInstanceDestroy",
    "save:4",  # the warm instance forgotten
]


@pytest.mark.parametrize("step", RECLAIM_STEPS)
def test_kill_while_reclaiming_a_warm_instance_then_retry(env: WarmEnv, step: str) -> None:
    kept = _park(env)
    other = env.claim("other", namespace="elsewhere")  # may not reuse it: reclaims it
    crashed = env.run("prepare", other, _arm(step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    env.ok("prepare", other)
    cp = env.checkpoint()
    assert cp.warm == ()
    (d,) = cp.claims[other].devices
    assert d.mig_uuid != kept  # never the other namespace's instance, even half reclaimed
    env.check_one_owner_each()
