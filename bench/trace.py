"""Public-trace packing benchmark: carve's policies against kube-scheduler's own allocator.

    python -m bench.trace                                  # the three trace variants, full cluster
    python -m bench.trace --nodes 60 --load 1.2            # a CI-sized slice
    python -m bench.trace --trace PATH --trace PATH2       # any task list of the same format
    python -m bench.trace --mode timeline --nodes 100 --speedup 80
    python -m bench.trace --mode timeline --queue --nodes 40 --speedup 40   # jobs wait

The trace is the Alibaba GPU cluster trace of Weng et al., "Beware of Fragmentation:
Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent" (USENIX ATC '23),
cluster-trace-gpu-v2023; its mapping onto MIG-capable catalogue models is stated in
tests/bench/alibaba.py and printed with every table. The replay (tests/bench/replay.py) gives
every policy the same cluster and the same jobs; the baseline is the real structured
allocator of kube-scheduler v1.37.2 (dra-allocate, built by hack/k8s/build.sh).

Columns:

- placed: fraction of the jobs placed on arrival (no queue: a job that does not fit is
  dropped); share: placed GPU share / offered GPU share (a job's share is its size on an
  8-slice GPU, 1/8 per memory slice, or its number of whole GPUs, whichever model it lands on);
  GPUs: the placed GPU share itself (placed memory units / 8);
- util: occupied memory slices as a share of each GPU, averaged over GPUs, at the end of a
  saturation run (the average after warm-up in a timeline run);
- frag: jobs refused while the cluster's free GPU share (on the models the job may use)
  covered the job: refusals caused by where free space lies, not by how much there is;
- /fluid, /LP: placed share as a fraction of the fluid bound (every memory slice usable, no
  geometry) and of the configuration-LP bound (MIG geometry per GPU, cpu and memory per GPU
  model; tests/bench/bounds.py); saturation runs only;
- dec/s, p99 ms: decisions per second and the 99th percentile of one decision (for the
  baseline this includes dra-allocate processes, so it is not comparable).

With ``--queue`` (timeline mode) a job that does not fit waits and is retried when capacity
frees (tests/bench/queued.py states the queue model): kube-scheduler's allocator and carve's
policies serve the queue in arrival order, as kube-scheduler's active queue does, and
``carve ... joint`` places it jointly (tests/bench/queue_placer.py), with the starvation
guard after ``--keep-after`` seconds. Then placed counts the jobs placed by the trace's last
arrival, util is the mean memory-slice utilisation while jobs waited (saturation), wait p50 /
p99 are the queueing delays (start - arrival, replay seconds) of every job placed, and p99 ms
is that of one scheduling pass.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from controller.placement.scoring import Policy
from tests.bench.alibaba import (
    CITATION,
    DEFAULT_TASKS,
    MAPPING_TEXT,
    NODE_FILE,
    TRACE_DIR,
    TraceNode,
    load_nodes,
    load_tasks,
)
from tests.bench.bounds import configuration_bound
from tests.bench.queued import QueuedFigures, in_order, joint, replay_queued
from tests.bench.replay import (
    Figures,
    Job,
    build_jobs,
    build_model,
    carve,
    cluster_gpus,
    fluid_bound,
    real,
    replay,
    select_nodes,
)
from tests.support.real_allocator import CachedAllocator

DEFAULT_VARIANTS = (
    DEFAULT_TASKS,
    "openb_pod_list_gpushare100.csv",
    "openb_pod_list_multigpu30.csv",
)
DEFAULT_CACHE = Path.home() / ".cache" / "carve" / "bench" / "dra-allocate-answers.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--trace",
        action="append",
        type=Path,
        help="a task list (openb_pod_list_*.csv format); repeatable; default: the three "
        f"variants in {TRACE_DIR}",
    )
    parser.add_argument("--node-file", type=Path, default=TRACE_DIR / NODE_FILE)
    parser.add_argument("--nodes", type=int, help="nodes, spread over the node list (default all)")
    parser.add_argument("--limit-tasks", type=int, help="at most this many jobs per trace")
    parser.add_argument("--mode", choices=("saturation", "timeline"), default="saturation")
    parser.add_argument(
        "--load",
        type=float,
        default=1.2,
        help="saturation: offered GPU share / cluster GPUs (default 1.2)",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="timeline: arrival gaps divided by this, lifetimes kept (default 1)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(p.value for p in Policy),
        help="carve packing policies to run (default: all)",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip kube-scheduler's allocator"
    )
    parser.add_argument(
        "--allocator-cache",
        type=Path,
        default=DEFAULT_CACHE,
        help="where the allocator's answers are kept between runs (they depend only on the "
        "dra-allocate binary, its gates and the question); '' for none",
    )
    parser.add_argument("--series", type=Path, help="write utilisation over time as CSV here")
    parser.add_argument(
        "--queue",
        action="store_true",
        help="timeline: jobs that do not fit wait and are retried when capacity frees",
    )
    parser.add_argument(
        "--joint",
        default=Policy.LEAST_WASTE.value,
        help="--queue: carve policies that also run with joint placement ('' for none)",
    )
    parser.add_argument(
        "--window", type=int, default=12, help="--queue: pods placed jointly per pass"
    )
    parser.add_argument(
        "--keep-after",
        type=_seconds_or_none,
        action="append",
        help="--queue: starvation guard, seconds of waiting after which a node is kept for a "
        "pod, or 'none'; repeatable (one joint run each); default: one run without the guard",
    )
    args = parser.parse_args(argv)
    if args.queue and args.mode != "timeline":
        parser.error("--queue needs --mode timeline (jobs leave only there)")

    traces = args.trace or [TRACE_DIR / v for v in DEFAULT_VARIANTS]
    nodes = select_nodes(load_nodes(args.node_file), args.nodes)
    policies = [Policy(p) for p in args.policies.split(",") if p]
    allocator = None
    cache = Path(args.allocator_cache) if str(args.allocator_cache) else None
    if not args.no_baseline:
        allocator = CachedAllocator()
        if cache is not None:
            loaded = allocator.load(cache)
            if loaded:
                print(f"allocator answers: {loaded} loaded from {cache}")

    print(f"trace: {CITATION}")
    print(f"mapping: {MAPPING_TEXT}")
    models: dict[str, int] = {}
    for n in nodes:
        models[n.model] = models.get(n.model, 0) + n.gpus
    print(
        f"cluster: {len(nodes)} nodes, {cluster_gpus(nodes)} GPUs "
        f"({', '.join(f'{k} {v}' for k, v in sorted(models.items()))}); mode {args.mode}, "
        + (f"load {args.load}" if args.mode == "saturation" else f"speedup {args.speedup}")
        + (", queued" if args.queue else "")
    )
    print(f"run: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs")
    rows: list[Row] = []
    series_lines = ["trace,policy,jobs_seen,utilization"]
    for path in traces:
        tasks = load_tasks(path)
        try:
            jobs = build_jobs(
                tasks,
                nodes,
                mode=args.mode,
                load=args.load,
                limit=args.limit_tasks,
                speedup=args.speedup,
            )
        except ValueError as exc:
            print(f"\n{path.name}: skipped ({exc})")
            continue
        offered = sum(j.request.share for j in jobs)
        if args.mode == "saturation":
            load = f"{offered:.1f} ({offered / cluster_gpus(nodes):.2f} x the cluster's GPUs)"
        else:
            load = _concurrency(jobs, cluster_gpus(nodes))
        print(f"\n{path.name}: {len(tasks)} tasks, {len(jobs)} jobs, offered GPU share {load}")
        fluid = lp = None
        if args.mode == "saturation":
            t0 = time.perf_counter()
            bound = fluid_bound(nodes, jobs)
            lp_bound = configuration_bound(nodes, jobs)
            fluid, lp = bound.share, lp_bound.share
            print(
                f"  bounds: fluid {bound.share:.1f} GPUs ({bound.jobs} jobs), configuration LP "
                f"{lp_bound.share:.1f} GPUs ({lp_bound.jobs:.0f} jobs), "
                f"{time.perf_counter() - t0:.1f}s"
            )
        makers: list[Callable[[], Figures]] = []
        if args.queue:
            makers = _queued_runs(args, nodes, jobs, policies, allocator)
        else:
            for make in [carve(p) for p in policies] + (
                [real(allocator)] if allocator is not None else []
            ):
                makers.append(functools.partial(replay, build_model(nodes), jobs, make))
        for run in makers:
            t0 = time.perf_counter()
            figures = run()
            rows.append((path.name, figures, fluid, lp))
            line = f"  {figures.name}: {time.perf_counter() - t0:.1f}s"
            print(line + (f"; {figures.notes}" if figures.notes else ""))
            series_lines.extend(
                f"{path.name},{figures.name},{n},{u:.4f}" for n, u in figures.series
            )
            if allocator is not None and cache is not None:
                allocator.save(cache)
        _print_variant(rows[-len(makers) :])
    print("\nsummary")
    _print_table(rows)
    if args.series:
        args.series.write_text("\n".join(series_lines) + "\n")
    return 0


def _seconds_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _queued_runs(
    args: argparse.Namespace,
    nodes: Sequence[TraceNode],
    jobs: Sequence[Job],
    policies: Sequence[Policy],
    allocator: CachedAllocator | None,
) -> list[Callable[[], Figures]]:
    services = [in_order(carve(p)) for p in policies]
    for name in [p for p in args.joint.split(",") if p]:
        for keep in args.keep_after or [None]:
            services.append(joint(Policy(name), window=args.window, keep_after=keep))
    if allocator is not None:
        services.append(in_order(real(allocator)))
    return [functools.partial(replay_queued, build_model(nodes), jobs, s) for s in services]


def _concurrency(jobs: Sequence[Job], gpus: int) -> str:
    """Offered GPU share alive at once in a timeline run: time average and peak."""
    events = sorted(
        [(j.arrival, j.request.share) for j in jobs]
        + [(j.departure if j.departure is not None else j.arrival, -j.request.share) for j in jobs]
    )
    if not events:
        return "0"
    alive = peak = area = 0.0
    last = events[0][0]
    for t, delta in events:
        area += alive * (t - last)
        last = t
        alive += delta
        peak = max(peak, alive)
    span = events[-1][0] - events[0][0]
    mean = area / span if span else 0.0
    return (
        f"alive {mean:.1f} on average ({mean / gpus:.2f} x GPUs), "
        f"peak {peak:.1f} ({peak / gpus:.2f} x)"
    )


Row = tuple[str, Figures, float | None, float | None]  # trace, figures, fluid and LP bounds


def _print_variant(rows: Sequence[Row]) -> None:
    _print_table(rows, indent="  ")
    by_name = {f.name: f for _, f, _, _ in rows}
    base = by_name.get("kube-scheduler allocator")
    if base is not None and base.share_placed:
        for name, f in by_name.items():
            if f is not base:
                print(
                    f"  {name} / allocator: placed share x{f.share_placed / base.share_placed:.4f}"
                    f", jobs x{f.placed / base.placed:.4f}"
                )


def _print_table(rows: Sequence[Row], indent: str = "") -> None:
    queued = any(isinstance(f, QueuedFigures) for _, f, _, _ in rows)
    wait = f" {'wait p50':>9} {'wait p99':>9}" if queued else ""
    print(
        f"{indent}{'trace':<32} {'policy':<40} {'placed':>7} {'share':>7} {'GPUs':>8} {'util':>7} "
        f"{'frag':>6} {'/fluid':>7} {'/LP':>7}{wait} {'dec/s':>8} {'p99 ms':>8}"
    )
    for trace, f, fluid, lp in rows:
        if isinstance(f, QueuedFigures):
            rate = f.decisions / f.seconds if f.seconds else 0.0
            p99 = f.pass_p99_ms
            wait = f" {f.wait_p50:>9.0f} {f.wait_p99:>9.0f}"
        else:
            rate = f.jobs / f.seconds if f.seconds else 0.0
            p99 = f.p99_ms
            wait = f" {'-':>9} {'-':>9}" if queued else ""
        print(
            f"{indent}{trace:<32} {f.name:<40} {f.placed_fraction:>7.3f} {f.share_fraction:>7.3f} "
            f"{f.share_placed:>8.1f} {f.utilization:>7.3f} {f.frag_failures:>6} "
            f"{_ratio(f.share_placed, fluid):>7} {_ratio(f.share_placed, lp):>7}{wait} "
            f"{rate:>8.0f} {p99:>8.2f}"
        )


def _ratio(value: float, bound: float | None) -> str:
    return f"{value / bound:.3f}" if bound else "-"


if __name__ == "__main__":
    raise SystemExit(main())
