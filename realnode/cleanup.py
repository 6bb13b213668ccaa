"""Leave nothing behind: every process, container, mount, cgroup and bridge of a real node.

Stopping the kubelet and containerd is not enough. containerd's runc shims are meant to
outlive containerd (they re-parent to init), the containers outlive the shims, and the kubelet
and containerd leave overlay, tmpfs and network-namespace mounts under their directories. This
module finds all of it from the node's directory and name alone, so it works the same after an
orderly stop, after a SIGKILL of the test runner (the reaper calls it) and from another shell
(``python -m realnode down``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

_log = logging.getLogger(__name__)

_CGROUP_V1 = Path("/sys/fs/cgroup")


def clean_node(
    root: Path, name: str, bridge: str, node_ip: str = "", *, remove_dir: bool = True
) -> list[str]:
    """Tear down whatever node ``name`` left under ``root``; returns what it did."""
    done: list[str] = []
    killed = _kill_cgroup_processes(name) + _kill_processes_using(root)
    if killed:
        done.append(f"killed {killed} process(es)")
    unmounted = _unmount_under(root)
    if unmounted:
        done.append(f"unmounted {unmounted} mount(s)")
    if _remove_link(bridge):
        done.append(f"removed bridge {bridge}")
    if node_ip and release_node_ip(node_ip):
        done.append(f"released node IP {node_ip}")
    removed = _remove_cgroups(name)
    if removed:
        done.append(f"removed {removed} cgroup(s)")
    if remove_dir and root.exists():
        shutil.rmtree(root, ignore_errors=True)
        done.append(f"removed {root}")
    return done


def node_cgroups(name: str) -> list[Path]:
    """Every cgroup directory (all v1 hierarchies) of the node's cgroup root, deepest first."""
    found: list[Path] = []
    if not name or not _CGROUP_V1.is_dir():
        return found
    for hierarchy in _CGROUP_V1.iterdir():
        top = hierarchy / f"carve-{name}"
        if top.is_dir() and not top.is_symlink():
            found.extend(Path(p) for p, _, _ in os.walk(top))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _kill_cgroup_processes(name: str) -> int:
    """SIGKILL every process in the node's cgroups (the pods' containers and sandboxes)."""
    total = 0
    for _ in range(20):
        pids = {pid for cg in node_cgroups(name) for pid in _pids_in(cg)}
        pids.discard(os.getpid())
        if not pids:
            return total
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        total += len(pids)
        time.sleep(0.1)
    return total


def _pids_in(cgroup: Path) -> Iterator[int]:
    with contextlib.suppress(OSError):
        for line in (cgroup / "cgroup.procs").read_text().split():
            yield int(line)


def _kill_processes_using(root: Path) -> int:
    """SIGKILL processes whose command line names the node directory: the kubelet, containerd,
    its shims (``-address <root>/containerd.sock``) and carve's plugin."""
    marker = (str(root).rstrip("/") + "/").encode()  # n1/ must not match n10/
    me = os.getpid()
    victims: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes():
                victims.append(int(entry.name))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in victims):
        time.sleep(0.05)
    return len(victims)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` (from /proc/self/mountinfo), deepest first."""
    prefix = str(root.resolve()) if root.exists() else str(root)
    points: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = _unescape(line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def _unmount_under(root: Path) -> int:
    count = 0
    for _ in range(5):
        points = mounts_under(root)
        if not points:
            break
        for point in points:
            done = subprocess.run(["umount", "-l", point], capture_output=True, check=False)
            count += done.returncode == 0
    return count


def _remove_link(name: str) -> bool:
    if not name or not Path(f"/sys/class/net/{name}").exists():
        return False
    done = subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)
    return done.returncode == 0


def claim_node_ip(ip: str) -> bool:
    """Add ``ip``/32 to ``lo``; False if it is there already (another node holds it), so the
    add doubles as the lock that keeps two node hosts from taking one node number."""
    done = subprocess.run(
        ["ip", "addr", "add", f"{ip}/32", "dev", "lo"], capture_output=True, check=False
    )
    return done.returncode == 0


def release_node_ip(ip: str) -> bool:
    done = subprocess.run(
        ["ip", "addr", "del", f"{ip}/32", "dev", "lo"], capture_output=True, check=False
    )
    return done.returncode == 0


def _remove_cgroups(name: str) -> int:
    removed = 0
    for cgroup in node_cgroups(name):
        with contextlib.suppress(OSError):
            cgroup.rmdir()
            removed += 1
    return removed


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
