"""Crash safety of the MIG-mode change for a whole-GPU claim (issue 11, point 4).

A real plugin process (tests/kubeletplugin/crash_worker.py) preparing or unpreparing a claim for
the whole of an H100 in MIG mode is SIGKILLed at every step, then a fresh process retries, as
the kubelet does. After the retry the claim is prepared with MIG mode off, or unprepared with
MIG mode on again; MIG mode is never left off without a record that owes turning it back on.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import CheckpointStore, ClaimState
from tests.kubeletplugin.crash_worker import DRIVER, NODE, FileClaims, run_worker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "sim.yaml"
        self.config.write_text(
            yaml.safe_dump({"state": str(root / "sim-state.json"), "gpus": ["H100-SXM5-80GB"]})
        )
        sim.configure(self.config)
        self.claims = FileClaims(root / "claims.json")
        self.uid = str(uuid.uuid4())
        self.claims.put(
            {
                "metadata": {"namespace": "ns", "name": "claim", "uid": self.uid,
                             "resourceVersion": "1", "finalizers": []},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
                ]}}},
            }
        )  # fmt: skip

    def run(self, op: str, crash_at: str = "") -> subprocess.CompletedProcess[str]:
        return run_worker(self.config, self.root, op, self.uid, crash_at)

    def error(self, proc: subprocess.CompletedProcess[str]) -> str:
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return str(out[self.uid]["error"])

    def mig_on(self) -> bool:
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            return b.mig_mode(b.gpus()[0].uuid).current

    def check_prepared(self) -> None:
        cp = CheckpointStore(self.root / "checkpoint").load()
        rec = cp.claims[self.uid]
        assert rec.state is ClaimState.PREPARE_COMPLETED
        assert rec.devices[0].restore_mig
        assert not self.mig_on()
        assert len(list((self.root / "cdi").iterdir())) == 1

    def check_unprepared(self) -> None:
        cp = CheckpointStore(self.root / "checkpoint").load()
        assert cp.claims == {}
        assert self.mig_on()
        cdi = self.root / "cdi"
        assert not cdi.exists() or list(cdi.iterdir()) == []
        obj = self.claims.raw("ns", "claim")
        assert obj is not None and not obj["metadata"].get("finalizers")


@pytest.fixture
def env(tmp_path: Path) -> Any:
    e = Env(tmp_path)
    yield e
    sim.configure(None)


PREPARE_STEPS = [
    "save:1",  # PrepareStarted written
    "save:2",  # finalizer recorded
    "save:3",  # the intent to restore MIG mode recorded, MIG mode still on
    "sim:before:DeviceSetMigMode",
    "sim:after:DeviceSetMigMode",  # MIG mode off, the reply lost
    "cdi-write",
    "save:4",  # PrepareCompleted written (the reply is lost)
]

UNPREPARE_STEPS = [
    "save:1",  # UnprepareStarted written
    "sim:before:DeviceSetMigMode",
    "sim:after:DeviceSetMigMode",  # MIG mode on again, the flag not yet cleared
    "save:2",  # flag cleared
    "cdi-remove",
    "save:3",  # record dropped
]


def _arm(step: str) -> str:
    if not step.startswith("sim:"):
        return step
    sim.sim_crash_at(step[4:], tag="worker")
    return ""


@pytest.mark.parametrize("step", PREPARE_STEPS)
def test_kill_during_prepare_then_retry(env: Env, step: str) -> None:
    crashed = env.run("prepare", _arm(step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    assert env.error(env.run("prepare")) == ""
    env.check_prepared()
    assert env.error(env.run("unprepare")) == ""
    env.check_unprepared()


@pytest.mark.parametrize("step", PREPARE_STEPS)
def test_kill_during_prepare_then_give_up(env: Env, step: str) -> None:
    """The pod is deleted instead of retried: a restart plus unprepare restores MIG mode."""
    crashed = env.run("prepare", _arm(step))
    assert crashed.returncode == -9
    sim.sim_clear_faults()
    assert env.error(env.run("unprepare")) == ""
    env.check_unprepared()


@pytest.mark.parametrize("step", UNPREPARE_STEPS)
def test_kill_during_unprepare_then_retry(env: Env, step: str) -> None:
    assert env.error(env.run("prepare")) == ""
    env.check_prepared()
    crashed = env.run("unprepare", _arm(step))
    assert crashed.returncode == -9, f"step {step} was never reached: {crashed.stderr[-2000:]}"
    sim.sim_clear_faults()
    assert env.error(env.run("unprepare")) == ""
    env.check_unprepared()
    assert env.error(env.run("prepare")) == ""  # and the GPU can be had whole again
    env.check_prepared()
