"""Foreign objects: carve-controller's memory and decision time next to another driver's claims
and slices (issue 30.6).

Run: python -m bench.foreign_objects [--counts 0,50000] [--pods 24] [--compare main=/tree]

One private v1.37 control plane is started with a small fake GPU fleet (`--gpu-nodes`, 8 GPUs
each, the plugin's exact slices). At each count, the apiserver is given that many ResourceClaims
of another driver's class (spread over 10 namespaces) and as many of its ResourceSlices (four
NICs each); then a fresh carve-controller starts, and `--pods` gated pods are placed through it.
Printed per count and controller (`--compare LABEL=TREE` runs another source tree's controller,
e.g. a `git worktree` of main, on the same objects in the same session):
- ready s: process start to /readyz (every informer has listed);
- RSS MB once ready, and peak MB (VmHWM) by the end, from /proc;
- decision ms: mean of `carve_decision_seconds` over the batch, and its p99.
Then the bytes the caches keep per object of each kind (`bytes_per_object`).

Figures are printed, not asserted (tests/bench/test_foreign_objects.py runs the machinery at a
small count and checks only that it works).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.scale import compared_controllers
from tests.support.foreign import (
    HEADER,
    ForeignBench,
    ForeignConfig,
    ForeignFigures,
    bytes_per_object,
    format_row,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="0,50000", help="comma-separated foreign counts")
    parser.add_argument("--pods", type=int, default=24, help="gated pods placed per measurement")
    parser.add_argument("--gpu-nodes", type=int, default=4, help="fake GPU nodes (8 GPUs each)")
    parser.add_argument("--creators", type=int, default=16, help="threads creating objects")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=TREE")
    args = parser.parse_args(argv)
    cfg = ForeignConfig(
        counts=tuple(sorted(int(n) for n in args.counts.split(","))),
        gpu_nodes=args.gpu_nodes,
        pods=args.pods,
        creators=args.creators,
        controllers=compared_controllers(args.compare),
    )
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster

    root = Path(tempfile.mkdtemp(prefix="carve-foreign-"))
    cluster = LocalCluster(root / "cluster")
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"foreign_objects: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    bench = ForeignBench(info, root, cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    figures: list[ForeignFigures] = []
    try:
        bench.install()
        for f in bench.run():
            figures.append(f)
            print(format_row(f), file=sys.stderr, flush=True)
    finally:
        bench.close()
        print(HEADER)
        for f in figures:
            print(format_row(f))
        print("\nbytes the controller's caches keep per object:")
        for what, size in bytes_per_object().items():
            print(f"  {what:<26} {size:>8.0f}")
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
