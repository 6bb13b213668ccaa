"""A full cluster with a queue: what each pod that ends costs carve's deciding thread.

Run: python -m bench.waiting [--nodes 10] [--pods 800] [--ends 30]

carve's reconciler and planner (`Reconciler`, `EnginePlanner`) run in process, fed
bench.scale's fleet (`--nodes` nodes of 8 GPUs, the four models in turn, the plugin's exact
ResourceSlices) and carve's DeviceClasses. `--pods` pods arrive at once, each with a claim as
kube-controller-manager generates it from bench.scale's templates (1g, 1g, 2g, 3g in turn);
what does not fit waits. Then the oldest running pod ends, `--ends` times, one at a time: each
end frees a slice, every waiting pod is tried again, and one of them usually takes it.

Run twice on the same fleet: with the planner's sharing of refusals between identical requests
off (`shared_refusal_s=0`, every waiting pod searched for) and on (the controller's default).
Printed per run: pods waiting after the fill, pods placed by the ends, the engine's searches
per end and the deciding thread's CPU time per end. Figures are printed, not asserted
(tests/bench/test_waiting.py runs the machinery, tests/support/waiting.py, on one node).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tests.support.waiting import report, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.waiting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--pods", type=int, default=800, help="pods that arrive at once")
    parser.add_argument("--ends", type=int, default=30, help="running pods that end, in turn")
    args = parser.parse_args(argv)
    if min(args.nodes, args.pods, args.ends) < 1:
        parser.error("--nodes, --pods and --ends must be at least 1")
    runs = [
        run(args.nodes, args.pods, args.ends, 0.0, "off"),
        run(args.nodes, args.pods, args.ends, 1.0, "on"),
    ]
    print(report(runs))
    off, on = runs
    if off.searches and on.cpu_s and off.cpu_s:
        print(
            f"on / off: searches x{on.searches / off.searches:.3f}, "
            f"CPU per end x{sum(on.cpu_s) / sum(off.cpu_s):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
