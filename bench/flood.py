"""One namespace floods carve with waiting pods; does another namespace still get placed, and
does the controller's memory stay bounded? (issue 41.5)

Run: python -m bench.flood [--pods 50000] [--tenant-pods 100] [--compare main=/tree]

Each controller (this tree's, and with `--compare LABEL=TREE` another source tree's, e.g. a
`git worktree` of main) gets a fresh private v1.37 control plane: a fake GPU fleet of
`--gpu-nodes` nodes (8 GPUs each; half pool=batch, half pool=interactive), `--pods` pods in
namespace `flood` written as a training job's pods are, each asking for a 1g slice on a batch
node (the first fill the batch nodes, the rest wait), then `--tenant-pods` pods in namespace
`tenant` asking for a 1g slice on an interactive node, where all fit. Only the tenant's
namespace is matched by carve's mutating admission policies; the flood's pods carry carve's
gate themselves (tests/support/flood.py `GATED_LABEL` says why). kube-controller-manager
runs with a raised client rate (`--client-qps`), so the flood's claims are made at the rate the
apiserver takes them, not at its default 20 per second.

Printed per controller, and last as the line the issue asks for:
`pods=<n> controller_rss_mb=<MB> other_namespace_p99_s=<s> shed=<n>` (RSS at the end; the
tenant's p99 from each pod's creation to its placement; pods the controller shed). Figures are
printed, not asserted (tests/bench/test_flood.py runs the machinery at a small count).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.scale import compared_controllers
from tests.support.flood import FloodConfig, FloodFigures, FloodRun


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=50_000, help="pods of the flooding namespace")
    parser.add_argument("--tenant-pods", type=int, default=100, help="pods of the other namespace")
    parser.add_argument("--gpu-nodes", type=int, default=6, help="fake GPU nodes (8 GPUs each)")
    parser.add_argument("--creators", type=int, default=16, help="threads creating pods")
    parser.add_argument("--client-qps", type=float, default=1000.0, help="for kcm and scheduler")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE")
    parser.add_argument("--controller-flag", action="append", default=[], metavar="FLAG")
    args = parser.parse_args(argv)
    cfg = FloodConfig(
        pods=args.pods,
        tenant_pods=args.tenant_pods,
        gpu_nodes=args.gpu_nodes,
        creators=args.creators,
        controllers=compared_controllers(args.compare),
        extra=tuple(args.controller_flag),
        admit_flood=False,
    )
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster

    figures: list[FloodFigures] = []
    for label, source in cfg.controllers:
        root = Path(tempfile.mkdtemp(prefix=f"carve-flood-{label}-"))
        cluster = LocalCluster(root / "cluster", client_qps=args.client_qps)
        try:
            info = cluster.start()
        except BinariesUnavailableError as exc:
            print(f"flood: control plane unavailable: {exc}", file=sys.stderr)
            return 2
        run = FloodRun(info, root, cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
        try:
            run.install()
            figures.append(run.run(label, source)[0])
            print(figures[-1].describe(), file=sys.stderr, flush=True)
        finally:
            run.close()
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
    for f in figures:
        print(f"{f.controller}: {f.describe()}")
    for f in figures:
        print(f"{f.controller}: {f.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
