"""MPS sharing in the prepare state machine: one control daemon per claim (issue 16).

The simulator's driver root carries the nvidia-cuda-mps-control stand-in; the plugin's own
discovery and MPS code drive it exactly as they would drive the real daemon.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from driver import cdi
from driver.cdi import CdiWriter
from driver.driverroot import discover
from driver.nvml import sim
from driver.nvml.sim.mpscontrol import CONTROL_LOG
from kubeletplugin.checkpoint import CheckpointStore, ClaimState
from kubeletplugin.mps import PID_FILE, MpsControl, _alive, find_binary
from kubeletplugin.nodehardware import NodeHardware
from kubeletplugin.prepare import Preparer, PreparerSettings
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, mps_config, open_node, whole

H100 = "H100-SXM5-80GB"


def _preparer(n: Node, tmp_path: Path, *, mps_binary: bool = True) -> Preparer:
    files = discover(tmp_path / "driver", version=n.backend.gpus()[0].driver_version, hook_dirs=())
    return Preparer(
        settings=PreparerSettings(DRIVER, NODE, NODE),
        backend=n.backend,
        claims=n.claims,
        store=CheckpointStore(n.checkpoint_dir),
        cdi=CdiWriter(n.cdi_root, vendor=DRIVER),
        common_nodes=NodeHardware(n.backend, sim.sim_proc_root()).common_device_nodes(),
        shared_edits=files.spec_edits(),
        dev_root=tmp_path / "devroot",
        mps=MpsControl(
            find_binary(tmp_path / "driver") if mps_binary else None,
            tmp_path / "plugins" / DRIVER / "mps",
            timeout=30,
        ),
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [H100])
    sim.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    n.preparer = _preparer(n, tmp_path)
    n.p.reconcile()
    yield n
    for rec in n.p.checkpoint().claims.values():  # never leave a daemon behind a failed test
        if rec.mps is not None and rec.mps.pid is not None and _alive(rec.mps.pid):
            os.kill(rec.mps.pid, signal.SIGKILL)
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _wait_dead(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_prepare_starts_one_configured_daemon_and_unprepare_stops_it(
    node: Node, tmp_path: Path
) -> None:
    dev = mig(node.backend, 0, 19, 3)
    ref = node.claims.add(
        "shared",
        [dev],
        config=mps_config(defaultActiveThreadPercentage=40, defaultPinnedDeviceMemoryLimit="4Gi"),
    )
    assert node.p.prepare([ref])[ref.uid].error == ""

    rec = node.p.checkpoint().claims[ref.uid]
    assert rec.state is ClaimState.PREPARE_COMPLETED
    assert rec.mps is not None and rec.mps.pid is not None and _alive(rec.mps.pid)
    mig_uuid = rec.devices[0].mig_uuid
    assert rec.mps.visible_devices == (mig_uuid,)
    top = tmp_path / "plugins" / DRIVER / "mps" / ref.uid
    assert rec.mps.pipe_dir == str(top / "pipe")
    log = (top / "log" / CONTROL_LOG).read_text()
    assert f"CUDA_VISIBLE_DEVICES={mig_uuid}" in log
    assert "CMD set_default_active_thread_percentage 40" in log
    assert "CMD set_default_device_pinned_mem_limit 0 4096M" in log

    spec = cdi.load_spec(node.cdi_root / f"{DRIVER}-claim_{ref.uid}.json")
    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    assert mounts["/tmp/nvidia-mps"]["hostPath"] == str(top / "pipe")
    assert "ro" not in mounts["/tmp/nvidia-mps"]["options"]
    (device,) = spec["devices"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in device["containerEdits"]["env"]
    # The daemon has the limits; a container's own (per-client) variables must stay its own.
    assert not [e for e in device["containerEdits"]["env"] if e.startswith("CUDA_MPS_ACTIVE")]
    assert not [e for e in spec["containerEdits"].get("env", []) if e.startswith("CUDA_MPS_A")]
    assert "CARVE_SHARING_STRATEGY=MPS" in device["containerEdits"]["env"]

    # Asked again (the kubelet retries): the same daemon, nothing new started.
    assert node.p.prepare([ref])[ref.uid].error == ""
    assert node.p.checkpoint().claims[ref.uid].mps == rec.mps

    assert node.p.unprepare([ref])[ref.uid] == ""
    assert _wait_dead(rec.mps.pid)
    assert not top.exists()
    assert ref.uid not in node.p.checkpoint().claims
    assert list(node.backend.instances(rec.devices[0].gpu_uuid)) == []


def test_a_restart_keeps_an_answering_daemon_and_restarts_a_dead_one(
    node: Node, tmp_path: Path
) -> None:
    ref = node.claims.add(
        "c", [mig(node.backend, 0, 19, 0)], config=mps_config(defaultActiveThreadPercentage=25)
    )
    assert node.p.prepare([ref])[ref.uid].error == ""
    first = node.p.checkpoint().claims[ref.uid].mps
    assert first is not None and first.pid is not None

    # The plugin restarts: a new Preparer on the same checkpoint keeps the daemon.
    node.p.close()
    node.preparer = _preparer(node, tmp_path)
    node.p.reconcile()
    assert node.p.checkpoint().claims[ref.uid].mps == first
    assert _alive(first.pid)

    # The daemon dies: the next start-up starts it again with the same settings.
    os.kill(first.pid, signal.SIGKILL)
    assert _wait_dead(first.pid)
    node.p.close()
    node.preparer = _preparer(node, tmp_path)
    node.p.reconcile()
    again = node.p.checkpoint().claims[ref.uid].mps
    assert again is not None and again.pid is not None and again.pid != first.pid
    assert _alive(again.pid)
    log = (Path(again.log_dir) / CONTROL_LOG).read_text()
    assert log.count("CMD set_default_active_thread_percentage 25") == 2

    # Housekeeping does the same while the plugin runs.
    os.kill(again.pid, signal.SIGKILL)
    assert _wait_dead(again.pid)
    node.p.retry_pending()
    third = node.p.checkpoint().claims[ref.uid].mps
    assert third is not None and third.pid not in (None, again.pid)

    assert node.p.unprepare([ref])[ref.uid] == ""
    assert third.pid is not None and _wait_dead(third.pid)


def test_a_crash_before_the_pid_was_recorded_leaves_no_orphan(node: Node, tmp_path: Path) -> None:
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 1)], config=mps_config())
    assert node.p.prepare([ref])[ref.uid].error == ""
    rec = node.p.checkpoint().claims[ref.uid]
    assert rec.mps is not None and rec.mps.pid is not None
    pid = rec.mps.pid
    # As if the plugin died after starting the daemon, before the prepare completed.
    node.p.ledger.put(
        replace(rec, state=ClaimState.PREPARE_STARTED, mps=replace(rec.mps, pid=None))
    )
    node.p.close()
    node.preparer = _preparer(node, tmp_path)
    node.p.reconcile()
    assert ref.uid not in node.p.checkpoint().claims
    assert _wait_dead(pid)  # found through its pid file and told to quit


def test_bad_mps_settings_are_refused_before_carving(node: Node) -> None:
    too_big = node.claims.add(
        "big",
        [mig(node.backend, 0, 19, 2)],
        config=mps_config(defaultPinnedDeviceMemoryLimit="20Gi"),
    )
    err = node.p.prepare([too_big])[too_big.uid].error
    assert "defaultPinnedDeviceMemoryLimit 20480Mi is more than the 1g.10gb slice's memory" in err
    on_gpu = node.claims.add(
        "gpu", [whole(0)], config=mps_config(defaultPinnedDeviceMemoryLimit="100Gi")
    )
    err = node.p.prepare([on_gpu])[on_gpu.uid].error
    assert "defaultPinnedDeviceMemoryLimit 102400Mi is more than the memory of gpu-0" in err
    uuid = node.backend.gpus()[0].uuid
    assert node.backend.mig_enabled(uuid)  # refused before MIG mode went off
    assert node.p.checkpoint().claims == {}


def test_a_whole_gpu_claim_gets_its_daemon_on_the_gpu_and_mig_mode_back_after_it(
    node: Node, tmp_path: Path
) -> None:
    """Issue 31, point 4: MPS on a whole GPU, as NVIDIA's gpu-test-mps examples share one
    (before, refused: 'MPS sharing is supported on MIG slices only'). The daemon serves the
    GPU by its UUID once MIG mode is off, lives through a restart like a slice's, and is gone
    before MIG mode goes back on (NVML refuses the change while a process holds the GPU)."""
    uuid = node.backend.gpus()[0].uuid
    ref = node.claims.add(
        "whole",
        [whole(0)],
        config=mps_config(defaultActiveThreadPercentage=30, defaultPinnedDeviceMemoryLimit="40Gi"),
    )
    assert node.p.prepare([ref])[ref.uid].error == ""
    assert not node.backend.mig_enabled(uuid)
    rec = node.p.checkpoint().claims[ref.uid]
    assert rec.state is ClaimState.PREPARE_COMPLETED and rec.devices[0].restore_mig
    assert rec.mps is not None and rec.mps.pid is not None and _alive(rec.mps.pid)
    assert rec.mps.visible_devices == (uuid,)
    log = (Path(rec.mps.log_dir) / CONTROL_LOG).read_text()
    assert f"CUDA_VISIBLE_DEVICES={uuid}" in log
    assert "CMD set_default_active_thread_percentage 30" in log
    assert "CMD set_default_device_pinned_mem_limit 0 40960M" in log
    spec = cdi.load_spec(node.cdi_root / f"{DRIVER}-claim_{ref.uid}.json")
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts["/tmp/nvidia-mps"] == rec.mps.pipe_dir
    (device,) = spec["devices"]
    env = device["containerEdits"]["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env
    assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in env

    # A restarted plugin adopts it, as it does a slice's.
    node.p.close()
    node.preparer = _preparer(node, tmp_path)
    node.p.reconcile()
    assert node.p.checkpoint().claims[ref.uid].mps == rec.mps and _alive(rec.mps.pid)

    daemon_at_restore: list[bool] = []
    enable = node.backend.enable_mig

    def enable_mig(gpu_uuid: str) -> None:
        assert rec.mps is not None and rec.mps.pid is not None
        daemon_at_restore.append(_alive(rec.mps.pid))
        enable(gpu_uuid)

    node.backend.enable_mig = enable_mig  # type: ignore[method-assign]
    assert node.p.unprepare([ref])[ref.uid] == ""
    assert daemon_at_restore == [False]  # stopped first, then MIG mode back on
    assert node.backend.mig_enabled(uuid)
    assert ref.uid not in node.p.checkpoint().claims


def test_without_the_binary_mps_claims_are_refused(node: Node, tmp_path: Path) -> None:
    node.p.close()
    node.preparer = _preparer(node, tmp_path, mps_binary=False)
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 4)], config=mps_config())
    err = node.p.prepare([ref])[ref.uid].error
    assert "no nvidia-cuda-mps-control" in err


def _ask(binary: Path, pipe_dir: str, *lines: str) -> subprocess.CompletedProcess[str]:
    """A client of the daemon on `pipe_dir`, as a tenant's process runs it."""
    return subprocess.run(
        [str(binary)],
        input="".join(f"{line}\n" for line in lines),
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_tenant_cannot_make_the_plugin_kill_another_claims_daemon(
    node: Node, tmp_path: Path
) -> None:
    """The pipe directory is mounted writable into the claim's containers, so the pid file the
    daemon writes there is the tenant's to rewrite. A tenant that quits its own daemon and
    writes the pid of another claim's daemon into that file must not get the other daemon
    killed: neither by housekeeping (which finds its own daemon dead and restarts it) nor by
    the unprepare of its claim."""
    binary = find_binary(tmp_path / "driver")
    assert binary is not None
    a = node.claims.add("a", [mig(node.backend, 0, 19, 0)], config=mps_config())
    b = node.claims.add(
        "b", [mig(node.backend, 0, 19, 1)], config=mps_config(defaultActiveThreadPercentage=30)
    )
    assert node.p.prepare([a])[a.uid].error == ""
    assert node.p.prepare([b])[b.uid].error == ""
    mps_a = node.p.checkpoint().claims[a.uid].mps
    mps_b = node.p.checkpoint().claims[b.uid].mps
    assert mps_a is not None and mps_a.pid is not None
    assert mps_b is not None and mps_b.pid is not None
    victim = mps_b.pid

    # The tenant of claim a, through its /tmp/nvidia-mps: its daemon quits, the pid file lies.
    assert _ask(binary, mps_a.pipe_dir, "quit").returncode == 0
    assert _wait_dead(mps_a.pid)
    (Path(mps_a.pipe_dir) / PID_FILE).write_text(f"{victim}\n")
    node.p.retry_pending()
    assert _alive(victim), "housekeeping killed another claim's MPS daemon"
    restarted = node.p.checkpoint().claims[a.uid].mps
    assert restarted is not None and restarted.pid not in (None, mps_a.pid, victim)

    # Again before the claim is unprepared: the teardown stops a's daemon only.
    (Path(mps_a.pipe_dir) / PID_FILE).write_text(f"{victim}\n")
    assert node.p.unprepare([a])[a.uid] == ""
    assert _wait_dead(restarted.pid)
    assert _alive(victim), "unprepare killed another claim's MPS daemon"
    answer = _ask(binary, mps_b.pipe_dir, "get_default_active_thread_percentage")
    assert answer.returncode == 0 and answer.stdout.split() == ["30.0"], answer
    assert node.p.unprepare([b])[b.uid] == ""
    assert _wait_dead(victim)


def test_a_checkpoint_naming_another_claims_daemon_does_not_get_it_killed(
    node: Node, tmp_path: Path
) -> None:
    """A checkpoint written by a plugin that believed the pid file may hold, for one claim, the
    pid of another claim's daemon: that process is not the claim's (its environment names the
    other pipe directory), so it is neither taken for the claim's daemon nor killed. The
    claim's own daemon, which the record lost track of, is told to quit through the claim's
    pipe and started again."""
    a = node.claims.add("a", [mig(node.backend, 0, 19, 0)], config=mps_config())
    b = node.claims.add("b", [mig(node.backend, 0, 19, 1)], config=mps_config())
    assert node.p.prepare([a])[a.uid].error == ""
    assert node.p.prepare([b])[b.uid].error == ""
    rec_a = node.p.checkpoint().claims[a.uid]
    mps_b = node.p.checkpoint().claims[b.uid].mps
    assert rec_a.mps is not None and rec_a.mps.pid is not None
    assert mps_b is not None and mps_b.pid is not None
    own = rec_a.mps.pid
    node.p.ledger.put(replace(rec_a, mps=replace(rec_a.mps, pid=mps_b.pid)))
    node.p.close()
    node.preparer = _preparer(node, tmp_path)
    node.p.reconcile()  # start-up: a's recorded daemon is not a's, so a's is started again
    assert _alive(mps_b.pid), "start-up killed another claim's MPS daemon"
    restarted = node.p.checkpoint().claims[a.uid].mps
    assert restarted is not None
    assert node.p.unprepare([a])[a.uid] == ""
    assert _alive(mps_b.pid), "unprepare killed another claim's MPS daemon"
    assert _wait_dead(own)
    assert restarted.pid not in (None, own, mps_b.pid) and _wait_dead(restarted.pid)
    assert node.p.unprepare([b])[b.uid] == ""
    assert _wait_dead(mps_b.pid)
