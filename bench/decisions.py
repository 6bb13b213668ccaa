"""The controller's planner alone, in process, on bench.scale's fleet: what one decision costs
without an apiserver, other threads or other processes in the way.

Run: python -m bench.decisions [--nodes 300] [--decisions 3000] [--live 500]

`EnginePlanner` (the planner carve-controller runs) is fed exactly what its informers would
give it for `--nodes` bench.scale fleet nodes (the Node with its status, the plugin's 16
ResourceSlices, 8 GPUs of the fleet's four models in turn) and carve's DeviceClasses. Then
`--decisions` pods are planned one after the other, each with a claim as kube-controller-manager
generates it from bench.scale's templates (1g, 1g, 2g, 3g in turn). A placed claim is fed back
allocated, as the controller's write would be; the oldest pod ends once `--live` are running,
and its claim goes. So the model churns as in bench.scale, without the apiserver.

Printed: wall-clock and thread-CPU p50 / p99 / max of `EnginePlanner.plan`, and the garbage
collections that ran inside a decision (by generation: how many, the longest), because in
bench.scale the decision thread's CPU tail is well above this benchmark's. Figures are printed,
not asserted (tests/bench/test_decisions.py runs the machinery, tests/support/decisions.py, on
one node).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tests.support.decisions import report, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decisions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--live", type=int, default=500, help="pods running at once")
    args = parser.parse_args(argv)
    if min(args.nodes, args.decisions, args.live) < 1:
        parser.error("--nodes, --decisions and --live must be at least 1")
    print(report(run(args.nodes, args.decisions, args.live)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
