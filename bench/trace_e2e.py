"""End to end: a shortened stretch of the public trace through the real control plane, carve's
controller against kube-scheduler's native path, next to the in-process replay of the same jobs.

    python -m bench.trace_e2e                # 40 jobs, 3 simulated nodes, ~1 min of arrivals
    python -m bench.trace_e2e --jobs 24 --nodes 2 --span 40 --trace PATH

The in-process figures of ``python -m bench.trace --queue`` come from carve's engine and
kube-scheduler's allocator library on a model of the cluster. This run checks them where it
matters: a private v1.37 control plane (kube-apiserver, kube-scheduler, kube-controller-manager),
simulated GPU nodes running the real carve-kubelet-plugin on the NVML simulator (nodesim), and

- **carve**: the real carve-controller (its default policy), pods gated by carve's admission
  policy in a gated namespace, claims of carve's DeviceClasses;
- **native**: kube-scheduler alone, pods not gated, claims of DeviceClasses outside carve's set
  that select the same published partitionable devices (MIG slices or whole GPUs).

Each path gets its own namespace and fresh nodes of the same specs, one path after the other.
The jobs (tests/bench/through_cluster.py, ``shorten``): a contiguous stretch of the
trace's timeline on the chosen nodes (spread over the trace's node list, GPU count, cpu and
memory kept), arrival gaps compressed so the stretch arrives within ``--span`` seconds,
lifetimes scaled so that the median one lasts ``--median-run`` seconds and clamped to
[``--min-run``, ``--max-run``]. A
job is a pod with one claim from a ResourceClaimTemplate (the trace's mapped request, as in
``bench.trace``), the trace's cpu and memory requests, and nodesim's run-seconds annotation
(the pod runs that long once started). Pods are created on schedule; a poll of the pods every
``--poll`` seconds stamps when each was bound and finished. Queueing delay is bound - created,
in wall seconds; it includes the control
plane's own latency (admission, claim creation, allocation, binding: about a second), which
the in-process replay does not have. *placed* counts pods bound by the last arrival.

The in-process replay runs on the same jobs (same wall-clock times) with the queue model of
tests/bench/queued.py: carve's controller policy served in order, and the allocator in arrival
order on the first node in name order. kube-scheduler's native path scores nodes
(NodeResourcesFit LeastAllocated and others), so its node choices can differ from the
allocator replay's name order; that difference is one of the things this run shows.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.placement.scoring import Policy
from tests.bench.alibaba import (
    CITATION,
    DEFAULT_TASKS,
    NODE_FILE,
    TRACE_DIR,
    TraceNode,
    catalogue_model,
    load_nodes,
    load_tasks,
)
from tests.bench.queued import QueuedFigures, in_order, replay_queued
from tests.bench.replay import Job, build_model, carve, real, select_nodes
from tests.bench.through_cluster import (
    CONTROLLER_POLICY,
    PathFigures,
    Shortening,
    native_classes,
    run_path,
    shorten,
)

# ---------------------------------------------------------------------------------------------
# The run


def in_process(
    nodes: Sequence[TraceNode], jobs: Sequence[Job], allocator: Any | None
) -> list[QueuedFigures]:
    runs = [in_order(carve(CONTROLLER_POLICY)), in_order(carve(Policy.LEAST_WASTE))]
    if allocator is not None:
        runs.append(in_order(real(allocator)))
    return [replay_queued(build_model(nodes), jobs, make) for make in runs]


def print_comparison(paths: Sequence[PathFigures], replays: Sequence[QueuedFigures]) -> None:
    print(f"{'run':<48} {'placed':>7} {'share':>7} {'wait p50':>9} {'wait p99':>9} {'mean':>7}")
    for p in paths:
        share = p.share_placed / p.share_asked if p.share_asked else 0.0
        print(
            f"{'e2e ' + p.name:<48} {p.placed / max(1, p.jobs):>7.3f} {share:>7.3f} "
            f"{p.wait_p50:>8.1f}s {p.wait_p99:>8.1f}s {p.wait_mean:>6.1f}s"
        )
    for f in replays:
        print(
            f"{'in-process ' + f.name:<48} {f.placed_fraction:>7.3f} {f.share_fraction:>7.3f} "
            f"{f.wait_p50:>8.1f}s {f.wait_p99:>8.1f}s {f.wait_mean:>6.1f}s"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace_e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", type=Path, default=TRACE_DIR / DEFAULT_TASKS)
    parser.add_argument("--node-file", type=Path, default=TRACE_DIR / NODE_FILE)
    parser.add_argument("--nodes", type=int, default=3, help="nodes, spread over the node list")
    defaults = Shortening()
    parser.add_argument("--jobs", type=int, default=defaults.jobs)
    parser.add_argument("--span", type=float, default=defaults.span)
    parser.add_argument("--median-run", type=float, default=defaults.median_run)
    parser.add_argument("--min-run", type=float, default=defaults.min_run)
    parser.add_argument("--max-run", type=float, default=defaults.max_run)
    parser.add_argument("--offset", type=float, default=defaults.offset)
    parser.add_argument("--poll", type=float, default=0.3)
    parser.add_argument("--no-baseline", action="store_true", help="skip the allocator replay")
    parser.add_argument("--paths", default="carve,native", help="which control-plane paths to run")
    args = parser.parse_args(argv)

    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster
    from nodesim.stack import CarveStack
    from tests.e2e.harness import GATED_NAMESPACES
    from tests.support.real_allocator import CachedAllocator

    how = Shortening(args.jobs, args.span, args.median_run, args.min_run, args.max_run, args.offset)
    nodes = select_nodes(load_nodes(args.node_file), args.nodes)
    jobs, compression = shorten(load_tasks(args.trace), nodes, how)
    print(f"trace: {CITATION}")
    print(
        f"run: {len(jobs)} jobs of {args.trace.name} from {args.offset:.0%} of its timeline, "
        f"arrivals within {args.span:g}s (1 wall second = {compression:.0f} trace seconds), "
        f"lifetimes scaled to a median of {args.median_run:g}s within "
        f"[{args.min_run:g}, {args.max_run:g}]s; nodes: "
        + ", ".join(f"{n.name} ({n.gpus} x {catalogue_model(n.model).key})" for n in nodes)
    )
    print(
        f"offered GPU share {sum(j.request.share for j in jobs):.1f} "
        f"on {sum(n.gpus for n in nodes)} GPUs"
    )
    allocator = None if args.no_baseline else CachedAllocator()
    replays = in_process(nodes, jobs, allocator)
    never = frozenset(replays[0].never_pods)
    for f in replays:
        print(f"  in-process {f.name}: {f.notes}")
    root = Path(tempfile.mkdtemp(prefix="carve-trace-e2e-"))
    cluster = LocalCluster(root / "cluster")
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"trace e2e: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    stack = CarveStack(Path(info.kubeconfig), root / "stack")
    paths: list[PathFigures] = []
    try:
        stack.install(gate_namespaces=GATED_NAMESPACES)
        native_classes(stack)
        stack.start_controller()
        for which in [p for p in args.paths.split(",") if p]:
            figures = run_path(
                stack, nodes, jobs, native=which == "native", poll=args.poll, expect_never=never
            )
            print(f"  e2e {figures.name}: {figures.wall_s:.0f}s; {figures.notes}")
            paths.append(figures)
    finally:
        stack.stop(delete_nodes=False)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print()
    print_comparison(paths, replays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
