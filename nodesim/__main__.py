"""``python -m nodesim demo|down|gpu|host`` — the cluster demo (`make demo`), its cleanup, and
a fault on one of its simulated GPUs (``gpu NODE INDEX hang|answer|fail ERROR``, nodesim.gpufault).

``demo --nodes auto|real|sim`` (``make demo NODES=...``): real nodes where this machine can run
them (auto, the default), or forced. ``host`` is internal: the demo starts it as a detached
process that runs the nodes and carve-controller until ``down``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nodesim import demo, gpufault


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"demo state directory (default {demo.default_dir()})",
    )
    parser = argparse.ArgumentParser(prog="python -m nodesim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "demo", parents=[common], help="start the cluster, carve, three GPU nodes and examples"
    )
    run.add_argument(
        "--nodes",
        choices=demo.NODE_MODES,
        default="auto",
        help="real nodes (containerd + kubelet), simulated ones, or real where possible (auto)",
    )
    run.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the pods")
    sub.add_parser("down", parents=[common], help="stop the demo's nodes, controller, cluster")
    gpu = sub.add_parser(
        "gpu",
        parents=[common],
        help="make a simulated GPU of the running demo hang or fail, or answer again",
    )
    gpu.add_argument("node", help="a demo node, e.g. demo-h100")
    gpu.add_argument("index", type=int, help="the GPU's NVML index on that node")
    gpu.add_argument("action", choices=gpufault.ACTIONS)
    gpu.add_argument("error", nargs="?", help="with fail: an NVML error, e.g. UNKNOWN")
    host = sub.add_parser("host", parents=[common], help=argparse.SUPPRESS)
    host.add_argument("--kubeconfig", type=Path, required=True)
    host.add_argument("--nodes", choices=(demo.REAL, demo.SIM), default=demo.SIM)
    args = parser.parse_args(argv)
    root: Path = (args.dir or demo.default_dir()).resolve()
    if args.command == "demo":
        return demo.run_demo(root, nodes=args.nodes, timeout=args.timeout)
    if args.command == "down":
        stopped = demo.down(root)
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        return 0
    if args.command == "gpu":
        try:
            print(gpufault.apply(root, args.node, args.index, args.action, args.error))
        except gpufault.GpuFaultError as e:
            print(f"python -m nodesim gpu: {e}", file=sys.stderr)
            return 2
        return 0
    return demo.run_host(root, args.kubeconfig, args.nodes)


if __name__ == "__main__":
    sys.exit(main())
