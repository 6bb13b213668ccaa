"""``python -m devcluster up|down|env|status|build`` — a detached local control plane for
manual work and the demo (tests use the pytest plugin, which owns its own cluster)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

from devcluster.binaries import REPO_ROOT, BinariesUnavailableError, cache_root, ensure_binaries
from devcluster.cluster import (
    ClusterStartError,
    LocalCluster,
    api_client_for,
    component_states,
    exclusive,
    read_state,
    stop_cluster_at,
)
from devcluster.nodes import HEARTBEAT_SECONDS, FakeNode, NodeHeartbeater, create_node


def default_dir() -> Path:
    return cache_root() / "devcluster" / "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster", description=__doc__)
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"cluster state directory (default {default_dir()})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or verify) the cached control-plane binaries")
    up = sub.add_parser("up", help="start a detached cluster and print how to use it")
    up.add_argument("--timeout", type=float, default=120.0)
    up.add_argument("--nodes", type=int, default=0, help="fake nodes to create (node-0, ...)")
    sub.add_parser("heartbeat", help=argparse.SUPPRESS)  # run by `up`, stopped by `down`
    sub.add_parser("down", help="stop the cluster recorded in --dir")
    sub.add_parser("env", help="print shell exports (KUBECONFIG, PATH with kubectl 1.37)")
    sub.add_parser("status", help="show component processes and apiserver readiness")
    args = parser.parse_args(argv)
    root: Path = args.dir or default_dir()

    try:
        if args.command == "build":
            binaries = ensure_binaries()
            print(binaries.etcd.parent)
            return 0
        if args.command == "up":
            return _up(root, args.timeout, args.nodes)
        if args.command == "heartbeat":
            return _heartbeat(root)
        if args.command == "down":
            with exclusive(root):
                stopped = stop_cluster_at(root)
            print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
            return 0
        if args.command == "env":
            return _env(root)
        return _status(root)
    except (BinariesUnavailableError, ClusterStartError) as exc:
        print(f"devcluster: {exc}", file=sys.stderr)
        return 1


def _up(root: Path, timeout: float, nodes: int) -> int:
    with exclusive(root):
        existing = read_state(root)
        if existing is not None and all(component_states(existing).values()):
            print(f"already running: {existing.server} (kubeconfig {existing.kubeconfig})")
            return 0
        if existing is not None:
            stop_cluster_at(root)  # half-dead leftovers from a crashed run
        ensure_binaries()
        begin = time.monotonic()
        cluster = LocalCluster(
            root,
            detached=True,
            progress=lambda m: print(f"  {m} ({time.monotonic() - begin:.1f}s)"),
        )
        info = cluster.start(timeout=timeout)
        # Keeps every fake node Ready, including ones created later by other tools.
        cluster.add_sidecar(
            "node-heartbeat",
            [sys.executable, "-m", "devcluster", "--dir", str(root), "heartbeat"],
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        api = cluster.api_client()
        for i in range(nodes):
            create_node(api, FakeNode(name=f"node-{i}"))
    print(f"cluster up in {info.started_seconds:.1f}s: {info.server}")
    if nodes:
        print(f"  nodes:      {', '.join(f'node-{i}' for i in range(nodes))} (kept Ready)")
    print(f"  kubeconfig: {info.kubeconfig}")
    print(f"  logs:       {root / 'logs'}")
    print(f'  use it:     eval "$(python -m devcluster --dir {shlex.quote(str(root))} env)"')
    return 0


def _heartbeat(root: Path) -> int:
    info = read_state(root)
    if info is None:
        print(f"devcluster: no cluster in {root}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    beater = NodeHeartbeater(api_client_for(info.kubeconfig), discover=True)
    while not stop.is_set():
        try:
            beater.beat_once()
        except Exception as exc:  # the apiserver may be restarting; keep beating
            print(f"heartbeat failed: {exc}", file=sys.stderr, flush=True)
        stop.wait(HEARTBEAT_SECONDS)
    return 0


def _env(root: Path) -> int:
    info = read_state(root)
    if info is None:
        print(f"devcluster: no cluster in {root}; run `python -m devcluster up`", file=sys.stderr)
        return 1
    for key, value in info.env().items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def _status(root: Path) -> int:
    info = read_state(root)
    if info is None:
        print(f"no cluster recorded in {root}")
        return 1
    states = component_states(info)
    for name, running in states.items():
        print(f"{name:26} {'running' if running else 'STOPPED'}")
    ready = _readyz(info.server, root)
    print(f"{'apiserver /readyz':26} {ready}")
    print(f"{'kubeconfig':26} {info.kubeconfig}")
    return 0 if all(states.values()) and ready == "ok" else 1


def _readyz(server: str, root: Path) -> str:
    import ssl

    ctx = ssl.create_default_context(cafile=str(root / "pki" / "ca.crt"))
    try:
        with urllib.request.urlopen(f"{server}/readyz", timeout=3, context=ctx) as r:
            return str(r.read().decode())
    except OSError as exc:
        return f"unreachable ({exc})"


if __name__ == "__main__":
    sys.exit(main())
