"""Packing benchmark: carve's three packing policies, in process, on one seeded trace.

    python -m bench.packing                # defaults: packing on 64 nodes, timing on 1000 x 8
    python -m bench.packing --help

The three are carve's own: best fit, least waste and first fit (``Policy.FIRST_FIT``: first GPU
in node order, first placement in NVML order). First fit is a naive reference, not a peer: no
peer places that way (kube-scheduler scores nodes before its allocator takes the first fitting
device). The peer is measured with ``--real-baseline`` here (kube-scheduler's own allocator on
the first fitting node in name order) and, end to end with the real kube-scheduler and its node
scoring, by ``python -m bench.cluster_packing``.

Every policy sees exactly the same arrivals (pods asking for one MIG profile by name, on a mix
of GPU models) and departures (a pod leaves after its lifetime, if it was placed). Figures:

- placed: fraction of arrivals that got a slice at arrival time (no queueing, so the number
  isolates the packing decision); placed-units weighs each arrival by its memory units, so a
  policy cannot look good by turning big requests away. A profile name weighs the fewest units
  it takes on any model of the cluster (``tests.support.cluster_builders.profile_units``: a
  ``1g.10gb`` is 1 unit, though it takes 2 on an A100-40GB), so a policy cannot look good by
  landing requests where they take more room either;
- utilization: occupied memory units / all memory units, averaged over arrivals after warm-up;
- fragmentation: of the free memory units, the fraction that cannot be used by the largest
  profile still creatable on their GPU, i.e. 1 - sum(size of largest creatable profile) /
  sum(free units), averaged like utilization. 0 means every GPU's free space is one usable
  block; high values mean free space is scattered in holes that big profiles cannot use;
- decisions/s and p50/p99 decision time of ``PlacementEngine.place`` on a cluster of
  ``--timing-nodes`` x ``--gpus-per-node`` GPUs kept at the trace's load.

The synthetic GPUs and claims come from tests/support/cluster_builders.py, the builders the
controller tests use, so the benchmark packs exactly what the tests check.

``--real-baseline`` adds kube-scheduler's own structured allocator (dra-allocate, see
bench/trace.py and tests/bench/replay.py) to the packing runs: the same arrivals and
departures, each claim asking for the profile by name on the models that have it, devices
chosen by the allocator on the first node (in name order) where they fit. It runs one
dra-allocate process per new node state, so it takes minutes.

The public-trace benchmark (Alibaba GPU trace, carve against the real allocator, with bounds)
is ``python -m bench.trace``.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from controller.claims import (
    Alternative,
    ClaimHold,
    ClaimKey,
    ClaimSpec,
    ConstraintKind,
    DeviceConstraint,
    DeviceRequest,
    ExactRequest,
)
from controller.model import ClusterModel
from controller.nodefit import PodNeeds, Resources
from controller.placement import (
    ClaimToPlace,
    NoPlacement,
    PlacementEngine,
    PlacementRequest,
    Policy,
)
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from driver.geometry import geometry_for
from tests.support.cluster_builders import (
    CLASSES,
    DRIVER,
    MIG_CLASS,
    build_cluster,
    profile_claim,
    profile_selector,
    profile_units,
)

# ---------------------------------------------------------------------------------------------
# The trace


@dataclass(frozen=True)
class Arrival:
    time: float
    pod: str
    profile: str
    lifetime: float


MEAN_LIFE = 100.0
DEFAULT_MODELS = ("A100-SXM4-80GB", "H100-SXM5-80GB", "A100-SXM4-40GB")
# Profile names and their weight in the mix; names shared by several models let the engine
# choose the model. Small slices dominate, as in inference-heavy clusters.
DEFAULT_MIX = (
    ("1g.10gb", 30),
    ("1g.20gb", 10),
    ("2g.20gb", 15),
    ("3g.40gb", 15),
    ("4g.40gb", 5),
    ("7g.80gb", 5),
    ("1g.5gb", 10),
    ("2g.10gb", 5),
    ("3g.20gb", 5),
)


def make_trace(
    seed: int, arrivals: int, capacity_units: int, load: float, mix: Sequence[tuple[str, int]]
) -> list[Arrival]:
    """Poisson arrivals whose offered load is ``load`` x the cluster's memory units."""
    rng = random.Random(seed)
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    sizes = {"1g": 1, "2g": 2, "3g": 4, "4g": 4, "7g": 8}
    mean_size = sum(sizes[n[:2]] * (2 if n in ("1g.20gb",) else 1) * w for n, w in mix) / sum(
        weights
    )
    mean_life = MEAN_LIFE
    rate = load * capacity_units / (mean_size * mean_life)
    t = 0.0
    out = []
    for i in range(arrivals):
        t += rng.expovariate(rate)
        out.append(
            Arrival(t, f"pod-{i}", rng.choices(names, weights)[0], rng.expovariate(1 / mean_life))
        )
    return out


@dataclass
class Figures:
    policy: Policy
    arrivals: int = 0
    placed: int = 0
    units_asked: int = 0
    units_placed: int = 0
    utilization: float = 0.0
    fragmentation: float = 0.0
    decisions: int = 0
    seconds: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    multi_ms: float = 0.0


def _occupancy_figures(model: ClusterModel) -> tuple[float, float]:
    used = total = free = usable = 0
    for record in model.gpus.values():
        units = record.inventory.model.memory_units
        total += units
        occ = record.occupancy
        if occ.blocked:
            used += units
            continue
        busy = bin(occ.state.occupied).count("1")
        used += busy
        free += units - busy
        geometry = record.geometry
        largest = 0
        for pid, n in geometry.admits(occ.state).items():
            if n:
                largest = max(largest, record.inventory.model.profile_by_id(pid).size)
        usable += largest
    return used / total, (1 - usable / free) if free else 0.0


def _profile_units(model: ClusterModel) -> dict[str, int]:
    """What a request for each profile name weighs (tests.support.cluster_builders)."""
    return profile_units({r.inventory.model for r in model.gpus.values()})


_Live = tuple[float, str, tuple[ClaimHold, ...]]  # (end time, pod, holds), a heap by end time


def prefill(
    model: ClusterModel, seed: int, utilization: float, mix: Sequence[tuple[str, int]]
) -> list[_Live]:
    """Fill every GPU with random slices from ``mix`` at random feasible starts up to about
    ``utilization`` of its memory units, without asking the engine. Gives the timing run a
    steady-state cluster (fragmented, many distinct GPU states) in a second instead of tens of
    thousands of decisions."""
    rng = random.Random(seed)
    weights = dict(mix)
    live: list[_Live] = []
    needs = Resources(1000, 2**30, 1)
    for n, uuid in enumerate(sorted(model.gpus)):
        record = model.gpus[uuid]
        gpu = record.inventory.model
        names = [p for p in gpu.profiles if p.name in weights]
        if not names:
            continue
        state = record.occupancy.state
        budget = utilization * gpu.memory_units
        for attempt in range(16):
            if bin(state.occupied).count("1") >= budget:
                break
            profile = rng.choices(names, [weights[p.name] for p in names])[0]
            starts = record.geometry.feasible_starts(state, profile.id)
            if not starts:
                continue
            start = rng.choice(starts)
            state = record.geometry.place(state, profile.id, start)
            pod = f"fill-{n}-{attempt}"
            hold = ClaimHold(
                ClaimKey("bench", pod, pod),
                record.node,
                (
                    AllocatedDevice(
                        "gpu",
                        DRIVER,
                        record.inventory.pool,
                        record.by_placement[(profile.id, start)].name,
                    ),
                ),
            )
            model.hold(hold)
            model.set_pod(pod, record.node, needs)
            live.append((rng.expovariate(1 / MEAN_LIFE), pod, (hold,)))
    heapq.heapify(live)
    return live


def run_trace(
    model: ClusterModel,
    policy: Policy,
    trace: Sequence[Arrival],
    *,
    warmup: float = 0.2,
    sample_every: int = 1,
    live: list[_Live] | None = None,
) -> Figures:
    """Replay ``trace`` through one engine; figures are sampled after the warm-up fraction."""
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
    needs = PodNeeds(Resources(1000, 2**30, 1))
    figures = Figures(policy)
    live = live if live is not None else []
    times: list[float] = []
    util_samples: list[float] = []
    frag_samples: list[float] = []
    start_sampling = int(len(trace) * warmup)
    sizes = _profile_units(model)
    for i, a in enumerate(trace):
        while live and live[0][0] <= a.time:
            _, pod, holds = heapq.heappop(live)
            for hold in holds:
                model.release(hold.claim)
            model.remove_pod(pod)
        request = PlacementRequest(a.pod, needs, (profile_claim(a.pod, a.profile),))
        t0 = time.perf_counter()
        result = engine.place(request)
        times.append(time.perf_counter() - t0)
        figures.arrivals += 1
        size = sizes.get(a.profile, 0)
        figures.units_asked += size
        if not isinstance(result, NoPlacement):
            figures.placed += 1
            figures.units_placed += size
            engine.commit(result, a.pod, needs)
            heapq.heappush(live, (a.time + a.lifetime, a.pod, result.holds()))
        if i >= start_sampling and i % sample_every == 0:
            u, f = _occupancy_figures(model)
            util_samples.append(u)
            frag_samples.append(f)
    figures.utilization = statistics.fmean(util_samples) if util_samples else 0.0
    figures.fragmentation = statistics.fmean(frag_samples) if frag_samples else 0.0
    figures.decisions = len(times)
    figures.seconds = sum(times)
    ordered = sorted(times)
    figures.p50_ms = ordered[len(ordered) // 2] * 1000
    figures.p99_ms = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return figures


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.packing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=64, help="nodes in the packing runs")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--arrivals", type=int, default=5000, help="arrivals per packing run")
    parser.add_argument(
        "--loads", default="0.9,1.2", help="offered loads (x capacity) of the packing runs"
    )
    parser.add_argument("--timing-nodes", type=int, default=1000)
    parser.add_argument("--timing-arrivals", type=int, default=5000)
    parser.add_argument(
        "--timing-fill", type=float, default=0.85, help="utilization the timing cluster starts at"
    )
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument(
        "--real-baseline",
        action="store_true",
        help="also run kube-scheduler's allocator (dra-allocate) on the packing runs",
    )
    args = parser.parse_args(argv)

    models = [gpu_model(k) for k in args.models.split(",")]
    for m in models:
        geometry_for(m)

    def units(nodes: int) -> int:
        return sum(models[i % len(models)].memory_units for i in range(nodes)) * int(
            args.gpus_per_node
        )

    for load in (float(x) for x in args.loads.split(",")):
        print(
            f"packing: {args.nodes} nodes x {args.gpus_per_node} GPUs "
            f"({', '.join(m.key for m in models)}), {args.arrivals} arrivals, load {load}, "
            f"seed {args.seed}"
        )
        trace = make_trace(args.seed, args.arrivals, units(args.nodes), load, DEFAULT_MIX)
        results = []
        for policy in (Policy.BEST_FIT, Policy.LEAST_WASTE, Policy.FIRST_FIT):
            cluster = build_cluster(args.nodes, args.gpus_per_node, models)
            results.append(run_trace(cluster, policy, trace))
        _print_table(results, timing=False)
        if args.real_baseline:
            _print_real(build_cluster(args.nodes, args.gpus_per_node, models), trace)

    print(
        f"timing: {args.timing_nodes} nodes x {args.gpus_per_node} GPUs prefilled to "
        f"{args.timing_fill:.0%} with random slices, then {args.timing_arrivals} arrivals "
        "at load 1.0"
    )
    trace = make_trace(
        args.seed + 1, args.timing_arrivals, units(args.timing_nodes), 1.0, DEFAULT_MIX
    )
    results = []
    for policy in (Policy.BEST_FIT, Policy.LEAST_WASTE, Policy.FIRST_FIT):
        t0 = time.perf_counter()
        cluster = build_cluster(args.timing_nodes, args.gpus_per_node, models)
        live = prefill(cluster, args.seed, args.timing_fill, DEFAULT_MIX)
        states = len(cluster.buckets)
        print(
            f"  {policy.value}: cluster built and prefilled in {time.perf_counter() - t0:.1f}s, "
            f"{len(live)} slices, {states} distinct (kind, state, node busy) buckets"
        )
        results.append(run_trace(cluster, policy, trace, sample_every=1000, live=live, warmup=0))
        results[-1].multi_ms = _multi_device_ms(cluster, policy)
    _print_table(results, timing=True)
    print(
        "  2-dev: median time of a pod asking for two 1g.10gb slices on the same GPU "
        "(matchAttribute parentUUID), which takes the multi-device search path"
    )
    return 0


def _multi_device_ms(model: ClusterModel, policy: Policy, tries: int = 15) -> float:
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
    selector = profile_selector("1g.10gb")
    same = DeviceConstraint((), ConstraintKind.MATCH, f"{DRIVER}/parentUUID")
    spec = ClaimSpec(
        (
            DeviceRequest(
                "gpu", (Alternative("gpu", ExactRequest(MIG_CLASS.name, (selector,), count=2)),)
            ),
        ),
        (same,),
    )
    needs = PodNeeds(Resources(1000, 2**30, 1))
    times = []
    for i in range(tries):
        request = PlacementRequest(
            f"multi-{i}", needs, (ClaimToPlace(ClaimKey("bench", f"multi-{i}"), spec),)
        )
        t0 = time.perf_counter()
        engine.place(request)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _print_real(model: ClusterModel, trace: Sequence[Arrival], *, warmup: float = 0.2) -> None:
    """The same trace through kube-scheduler's allocator (tests.bench.replay.RealScheduler)."""
    from tests.bench.alibaba import MappedRequest, claim_spec
    from tests.bench.replay import Job, real, replay
    from tests.support.real_allocator import CachedAllocator

    by_name: dict[str, list[str]] = {}
    for gm in {r.inventory.model for r in model.gpus.values()}:
        for p in gm.profiles:
            by_name.setdefault(p.name, []).append(gm.key)
    sizes = _profile_units(model)  # as run_trace counts placed units
    needs = PodNeeds(Resources(1000, 2**30, 1))
    jobs = []
    for a in trace:
        served = tuple(sorted(by_name.get(a.profile, ())))
        request = MappedRequest(
            False, 1, served, tuple((k, a.profile) for k in served), float(sizes[a.profile])
        )
        spec = claim_spec(request)
        jobs.append(Job(a.pod, None, request, spec, needs, a.time, a.time + a.lifetime))
    t0 = time.perf_counter()
    f = replay(model, jobs, real(CachedAllocator()), warmup=warmup, samples=len(jobs), lookahead=1)
    print(
        f"  {'allocator':<10} {f.placed_fraction:>8.3f} {f.share_fraction:>12.3f} "
        f"{f.utilization:>7.3f} {f.fragmentation:>7.3f}   (kube-scheduler's allocator, "
        f"{time.perf_counter() - t0:.0f}s: {f.notes}; util is per GPU, frag at the end)"
    )


def _print_table(results: Sequence[Figures], *, timing: bool) -> None:
    header = f"  {'policy':<10} {'placed':>8} {'placed-units':>12} {'util':>7} {'frag':>7}"
    if timing:
        header += f" {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'2-dev ms':>9}"
    print(header)
    for f in results:
        line = (
            f"  {f.policy.value:<10} {f.placed / f.arrivals:>8.3f} "
            f"{f.units_placed / f.units_asked:>12.3f} {f.utilization:>7.3f} "
            f"{f.fragmentation:>7.3f}"
        )
        if timing:
            line += (
                f" {f.decisions / f.seconds:>12.0f} {f.p50_ms:>8.3f} {f.p99_ms:>8.3f}"
                f" {f.multi_ms:>9.1f}"
            )
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
