"""One-file applies: a template and its pod in one `kubectl apply`, as every published example
is written, under load; how many did carve place (issue 30.4)?

Run: python -m bench.one_file_apply [--applies 100] [--churners 4] [--controller-tree TREE]
                                    [--without-sole-allocator]

One private v1.37 control plane with a small fake GPU fleet; carve's manifests installed (with
`deploy/manifests/31-sole-allocator.yaml` unless --without-sole-allocator) and a carve-controller
running (from TREE with --controller-tree, e.g. a `git worktree` of main). `--churners` threads
create and delete ResourceClaimTemplates in another namespace all along: the gate policy reads
templates from the apiserver's cache, and a busy cache is when a pod can arrive before its
template is seen. Then `--applies` files are applied one after another. Printed: how many pods
admission gated, how many escaped the gate, and how many claims carve allocated (its finalizer
on the claim) or kube-scheduler did. The target is every one by carve.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.support.onefile import OneFileBench, OneFileConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--applies", type=int, default=100)
    parser.add_argument("--churners", type=int, default=4, help="template-churning threads")
    parser.add_argument("--controller-tree", type=Path, help="run this tree's controller")
    parser.add_argument("--without-sole-allocator", action="store_true")
    args = parser.parse_args(argv)
    cfg = OneFileConfig(
        applies=args.applies,
        churners=args.churners,
        sole_allocator=not args.without_sole_allocator,
        source=args.controller_tree.resolve() if args.controller_tree else None,
    )
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster

    root = Path(tempfile.mkdtemp(prefix="carve-one-file-"))
    cluster = LocalCluster(root / "cluster")
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"one_file_apply: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    bench = OneFileBench(info, root, cfg, lambda m: print(m, file=sys.stderr, flush=True))
    try:
        bench.install()
        print(bench.run().row())
    finally:
        bench.close()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
