"""The simulator's state is the node's hardware: shared by real processes, and consistent after
a process is killed (SIGKILL) at any named step of carving or destroying."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from driver.catalog import Placement
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend

REPO = Path(__file__).resolve().parents[3]
TAG = "worker"


@pytest.fixture
def node(tmp_path: Path) -> Any:
    config = sim.sim_write_config(
        tmp_path / "sim.yaml",
        {"state": "state.json", "gpus": ["A100-SXM4-40GB", "H100-SXM5-80GB"], "uuid_seed": "p"},
    )
    sim.configure(config)
    backend = NvmlBackend(sim).open()
    yield config, backend
    backend.close()
    sim.configure(None)


def _worker(config: Path, *args: object, tag: str | None = TAG) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CARVE_SIM_CONFIG": str(config), "PYTHONPATH": str(REPO)}
    if tag:
        env["CARVE_SIM_FAULT_TAG"] = tag
    return subprocess.run(
        [sys.executable, "-m", "tests.driver.nvml.sim_worker", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _listing(backend: NvmlBackend) -> dict[str, list[dict[str, Any]]]:
    as_json = {
        g.uuid: [dataclasses.asdict(i) for i in backend.instances(g.uuid)] for g in backend.gpus()
    }
    return json.loads(json.dumps(as_json))  # tuples -> lists, as the worker prints them


def test_a_second_process_sees_exactly_the_same_instances(node: Any) -> None:
    config, backend = node
    a, h = backend.gpus()
    mine = [backend.carve(a.uuid, 9, 0), backend.carve(h.uuid, 15, 6)]
    theirs = _worker(config, "carve", 0, 19, 6)
    assert theirs.returncode == 0, theirs.stderr
    carved = json.loads(theirs.stdout)
    listed = _worker(config, "list")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == _listing(backend)
    gi_ids = {i.gi_id for i in backend.instances(a.uuid)}
    assert gi_ids == {mine[0].gi_id, carved["gi_id"]}
    # and the other process can undo what this one made
    assert _worker(config, "destroy", 1, mine[1].gi_id).returncode == 0
    assert backend.instances(h.uuid) == ()


def test_processes_carving_at_once_never_share_a_placement(node: Any) -> None:
    config, backend = node

    def carve(start: int) -> subprocess.CompletedProcess[str]:
        return _worker(config, "carve", 0, 19, start)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(carve, [0, 1, 2, 3, 3, 4, 5, 6]))
    ok = [json.loads(r.stdout) for r in results if r.returncode == 0]
    refused = [r for r in results if r.returncode != 0]
    assert len(ok) == 7 and len(refused) == 1  # the two racing for start 3: exactly one wins
    assert "PlacementTaken" in refused[0].stderr
    instances = backend.instances(backend.gpus()[0].uuid)
    assert sorted(i.placement.start for i in instances) == list(range(7))
    assert len({i.gi_id for i in instances}) == 7
    assert len({i.mig_uuid for i in instances}) == 7


CARVE_POINTS = [
    ("before:DeviceCreateGpuInstanceWithPlacement", 0, 0),
    ("after:DeviceCreateGpuInstanceWithPlacement", 1, 0),
    ("before:GpuInstanceCreateComputeInstance", 1, 0),
    ("after:GpuInstanceCreateComputeInstance", 1, 1),
    ("after:DeviceGetMigDeviceHandleByIndex", 1, 1),
]


@pytest.mark.parametrize(("point", "gis", "cis"), CARVE_POINTS)
def test_kill_during_carve_leaves_consistent_state(
    node: Any, point: str, gis: int, cis: int
) -> None:
    config, backend = node
    sim.sim_crash_at(point, tag=TAG)
    killed = _worker(config, "carve", 0, 14, 2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sim.sim_snapshot()["faults"] == []  # consumed before dying: a restart won't re-die
    uuid = backend.gpus()[0].uuid
    listed = _worker(config, "list", tag=None)
    assert json.loads(listed.stdout) == _listing(backend)
    instances = backend.instances(uuid)
    assert len(instances) == gis
    assert sum(len(i.ci_ids) for i in instances) == cis
    if instances:  # a restarted agent can finish the half-done carve or roll it back
        (inst,) = instances
        assert inst.placement == Placement(2, 2)
        done = backend.ensure_compute_instance(uuid, inst.gi_id)
        assert done.mig_uuid == backend.instances(uuid)[0].mig_uuid
        backend.destroy(uuid, inst.gi_id)
    assert backend.instances(uuid) == ()
    retry = _worker(config, "carve", 0, 14, 2)
    assert retry.returncode == 0, retry.stderr


DESTROY_POINTS = [
    ("before:ComputeInstanceDestroy", 1, 1),
    ("after:ComputeInstanceDestroy", 1, 0),
    ("before:GpuInstanceDestroy", 1, 0),
    ("after:GpuInstanceDestroy", 0, 0),
]


@pytest.mark.parametrize(("point", "gis", "cis"), DESTROY_POINTS)
def test_kill_during_destroy_leaves_consistent_state(
    node: Any, point: str, gis: int, cis: int
) -> None:
    config, backend = node
    uuid = backend.gpus()[1].uuid
    carved = backend.carve(uuid, 9, 4)
    sim.sim_crash_at(point, tag=TAG)
    killed = _worker(config, "destroy", 1, carved.gi_id)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    instances = backend.instances(uuid)
    assert len(instances) == gis
    assert sum(len(i.ci_ids) for i in instances) == cis
    again = _worker(config, "destroy", 1, carved.gi_id)  # the retry finishes the job
    assert again.returncode == 0, again.stderr
    assert backend.instances(uuid) == ()
