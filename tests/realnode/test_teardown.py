"""A real node leaves nothing behind, even when its owner is SIGKILLed: no kubelet, containerd,
shim, container or plugin process, no mount, no cgroup, no bridge, no node IP, no directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster.waiting import wait_for
from nodesim.stack import CarveStack
from realnode.cleanup import mounts_under, node_cgroups
from realnode.cluster import RealNodes

REPO = Path(__file__).resolve().parents[2]


def _processes_naming(root: str) -> list[str]:
    marker = (root.rstrip("/") + "/").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                found.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:120])
    return found


def _leftovers(ready: dict[str, str], node_name: str) -> list[str]:
    out = [f"process: {p}" for p in _processes_naming(ready["node_root"])]
    out += [f"mount: {m}" for m in mounts_under(Path(ready["node_root"]))]
    out += [f"cgroup: {c}" for c in node_cgroups(node_name)]
    if Path(f"/sys/class/net/{ready['bridge']}").exists():
        out.append(f"bridge: {ready['bridge']}")
    lo = subprocess.run(
        ["ip", "-o", "addr", "show", "dev", "lo"], check=False, capture_output=True, text=True
    )
    if f"{ready['node_ip']}/32" in lo.stdout:
        out.append(f"address: {ready['node_ip']} on lo")
    if Path(ready["root"]).exists():
        out.append(f"directory: {ready['root']}")
    return out


def test_a_sigkilled_owner_leaves_no_process_mount_cgroup_or_address(
    carve_real: tuple[CarveStack, RealNodes], tmp_path: Path
) -> None:
    stack, _ = carve_real
    node_name = "rn-owner-killed"
    ready_file = tmp_path / "ready.json"
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.realnode.owner_worker",
            str(stack.kubeconfig),
            node_name,
            str(ready_file),
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for("the worker's node and pod", lambda: ready_file.exists() or worker.poll(), 150)
        if worker.poll() is not None:
            pytest.fail(
                f"worker exited with {worker.returncode}:\n{(tmp_path / 'worker.log').read_text()}"
            )
        ready = json.loads(ready_file.read_text())
        assert _processes_naming(ready["node_root"]), "the node should be running before the kill"
        assert node_cgroups(node_name), "the pod's cgroups should exist before the kill"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        try:
            wait_for("the reaper to clean up", lambda: not _leftovers(ready, node_name), 60)
        except AssertionError:
            reaper_log = Path(ready["root"]) / "reaper.log"
            log_text = reaper_log.read_text() if reaper_log.exists() else "(no reaper log)"
            pytest.fail(f"left behind: {_leftovers(ready, node_name)}\nreaper log:\n{log_text}")
    finally:
        if worker.poll() is None:
            worker.kill()
        stack.kubectl(
            "delete",
            "pod",
            f"{node_name}-sleeper",
            "--force",
            "--grace-period=0",
            "--ignore-not-found",
            check=False,
        )
        stack.kubectl("delete", "node", node_name, "--ignore-not-found", check=False)
