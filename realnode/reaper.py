"""A watchdog that tears the real nodes down when their owner dies, however it dies.

The kubelet and containerd die with the test runner (parent-death signal), but the pods'
containers, their shims and the mounts do not. The reaper is a separate process in its own
session, not tied to the owner: it polls the owner's pid and, once the owner is gone, cleans
every node directory under the root it was given. An owner that stops cleanly removes the
root first; the reaper then finds nothing to do and exits.

    python -m realnode.reaper --owner PID --root DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from realnode import cleanup

_POLL_SECONDS = 0.5


def clean_root(root: Path) -> list[str]:
    """Clean every node recorded under ``root`` (each has a node.json), then ``root`` itself."""
    done: list[str] = []
    for state in sorted(root.glob("*/node.json")):
        try:
            node = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        done += cleanup.clean_node(
            Path(node["root"]), node["name"], node["bridge"], node.get("node_ip", "")
        )
    if root.exists():
        done += cleanup.clean_node(root, "", "", remove_dir=True)
    return done


def record_owner(root: Path, pid: int) -> None:
    """Say which process owns the nodes under ``root`` (``python -m realnode down`` leaves the
    roots of live owners alone)."""
    (root / "owner.json").write_text(json.dumps({"pid": pid}))


def owner_alive(root: Path) -> bool:
    try:
        pid = int(json.loads((root / "owner.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return _alive(pid)


def spawn(owner: int, root: Path) -> subprocess.Popen[bytes]:
    """Start a reaper for ``owner`` in a session of its own (it must survive the owner)."""
    log = (root / "reaper.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "realnode.reaper", "--owner", str(owner), "--root", str(root)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # realnode is test tooling, not an installed package: run from the checkout it is in.
        cwd=Path(__file__).resolve().parent.parent,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="realnode.reaper")
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args(argv)
    while _alive(args.owner) and args.root.exists():
        time.sleep(_POLL_SECONDS)
    if args.root.exists():
        for line in clean_root(args.root):
            print(f"reaper: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
