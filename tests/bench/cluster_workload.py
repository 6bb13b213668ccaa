"""What `python -m bench.cluster_packing` replays: a fleet of GPU nodes and timed jobs.

Pure (no I/O beyond reading a trace file the caller names): the same :class:`Workload` goes
through every arm of a run, so the arms see the same nodes, the same arrivals and the same
lifetimes. Two families build one:

- a file of the Alibaba trace's format (:func:`trace_workload`; the mapping onto MIG is
  ``tests.bench.alibaba.MAPPING_TEXT``, printed with every run);
- a MIG-native mix (``tests.bench.mig_mix``).

**Time.** A run has ``jobs`` arrivals at ``rate`` per wall second on average, so the arrivals
span ``jobs / rate`` seconds. Every job's lifetime (how long its pod runs once bound) is its
raw lifetime (the trace's ``deletion_time - creation_time``, or the mix's draw) times one
factor ``k``, clamped to [``min_run``, ``max_run``]. The *offered demand* at a moment is the GPU
share of the jobs that have arrived and, had each started on arrival, would still run. The
*window* (:attr:`Workload.window`) runs from ``window_from`` of the arrival span to the last
arrival, and ``k`` is chosen so that the offered demand averaged over the window is ``load``
times the fleet's GPUs (the *offered load*, :meth:`Workload.offered_load`).

Why a window? At the fleet sizes this machine can drive, a run's arrivals span only a few
lifetimes of the long jobs, so the cluster never reaches the steady state that a plain offered
load (arrival rate x mean work / capacity) describes: it fills, then churns. Measuring over a
window fixed by the workload alone (the same for every arm) leaves the fill out and keeps
every arm's saturated stretch in.

A job's *share* is ``MappedRequest.share``: its size on an 8-slice GPU (1/8 per memory slice of
the reference model) or its number of whole GPUs, the same whichever model it lands on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.bench.alibaba import (
    MAPPING_TEXT,
    MappedRequest,
    TraceNode,
    TraceTask,
    catalogue_model,
    map_task,
)
from tests.bench.replay import select_nodes

SIZE_CLASSES = ("1g", "2g-4g", "7g", "multi-GPU")
"""Waits are reported per class; 7g and multi-GPU are the *large* jobs."""
LARGE_CLASSES = frozenset({"7g", "multi-GPU"})


def size_class(request: MappedRequest) -> str:
    """1g, 2g-4g (2g, 3g and 4g slices), 7g (a 7g slice or one whole GPU) or multi-GPU."""
    if request.whole:
        return "multi-GPU" if request.count > 1 else "7g"
    shape = request.shape  # the reference model's profile, e.g. "3g"
    if shape == "1g":
        return "1g"
    if shape == "7g":
        return "7g"
    return "2g-4g"


@dataclass(frozen=True)
class NodeSpec:
    """One GPU node: ``gpus`` GPUs of catalogue model ``model``, cpu and memory to match."""

    name: str
    model: str  # catalogue key, e.g. H100-SXM5-80GB
    gpus: int
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True)
class TimedJob:
    """One pod with one ResourceClaim (``tests.bench.alibaba.claim_spec(request)``)."""

    name: str
    request: MappedRequest
    cpu_milli: int
    memory_mib: int
    arrival: float  # wall seconds from the start of the arm
    lifetime: float  # wall seconds the pod runs once bound

    @property
    def size_class(self) -> str:
        return size_class(self.request)


@dataclass(frozen=True)
class Timing:
    """How raw arrivals and lifetimes become wall seconds (see the module docstring)."""

    jobs: int = 900
    rate: float = 3.0  # arrivals per wall second, on average
    load: float = 1.2  # offered demand over the window / GPUs
    window_from: float = 0.4  # where the window starts, as a fraction of the arrival span
    min_run: float = 5.0
    max_run: float = 600.0

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.rate <= 0 or not 0 <= self.window_from < 1 or self.load <= 0:
            raise ValueError("jobs >= 1, rate > 0, load > 0 and 0 <= window_from < 1")
        if not 0 < self.min_run <= self.max_run:
            raise ValueError("0 < min_run <= max_run")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str  # every parameter that made it, printed with the figures
    nodes: tuple[NodeSpec, ...]
    jobs: tuple[TimedJob, ...]  # in arrival order
    lifetime_factor: float = 1.0  # k
    window_from: float = 0.0  # Timing.window_from
    notes: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def last_arrival(self) -> float:
        return self.jobs[-1].arrival if self.jobs else 0.0

    @property
    def window(self) -> tuple[float, float]:
        """From ``window_from`` of the arrival span to the last arrival: the same for every arm,
        fixed by the workload alone."""
        return (self.window_from * self.last_arrival, self.last_arrival)

    def offered_load(self) -> float:
        """Mean offered demand over :attr:`window`, divided by the GPU count."""
        lo, hi = self.window
        if hi <= lo or not self.gpus:
            return 0.0
        return _demand_integral(self.jobs, lo, hi) / (hi - lo) / self.gpus

    def by_class(self) -> dict[str, int]:
        counts = dict.fromkeys(SIZE_CLASSES, 0)
        for j in self.jobs:
            counts[j.size_class] += 1
        return counts


# ---------------------------------------------------------------------------------------------
# Offered demand


def _demand_steps(jobs: Sequence[TimedJob]) -> list[tuple[float, float]]:
    """(time, change of offered demand), sorted: each job adds its share from its arrival for
    its lifetime, as if it started on arrival."""
    steps = [(j.arrival, j.request.share) for j in jobs]
    steps += [(j.arrival + j.lifetime, -j.request.share) for j in jobs]
    steps.sort()
    return steps


def saturation_start(jobs: Sequence[TimedJob], gpus: float) -> float | None:
    """The first time the offered demand reaches ``gpus``; None if it never does."""
    demand = 0.0
    for t, delta in _demand_steps(jobs):
        demand += delta
        if demand >= gpus - 1e-9:
            return t
    return None


def _demand_integral(jobs: Sequence[TimedJob], lo: float, hi: float) -> float:
    total = 0.0
    for j in jobs:
        a, b = max(lo, j.arrival), min(hi, j.arrival + j.lifetime)
        if b > a:
            total += (b - a) * j.request.share
    return total


@dataclass(frozen=True)
class RawJob:
    """A job before :func:`timed`: arrival in raw units, lifetime in raw units."""

    name: str
    request: MappedRequest
    cpu_milli: int
    memory_mib: int
    arrival: float
    lifetime: float


def timed(raw: Sequence[RawJob], gpus: int, timing: Timing) -> tuple[list[TimedJob], float]:
    """Arrivals compressed to ``jobs / rate`` wall seconds and lifetimes scaled by the factor
    that offers ``load`` over the window; returns the jobs and k."""
    if not raw:
        return [], 1.0
    ordered = sorted(raw, key=lambda r: (r.arrival, r.name))
    t0 = ordered[0].arrival
    raw_span = ordered[-1].arrival - t0
    span = len(ordered) / timing.rate
    squeeze = span / raw_span if raw_span > 0 else 0.0
    arrivals = [round((r.arrival - t0) * squeeze, 3) for r in ordered]

    def build(k: float) -> list[TimedJob]:
        return [
            TimedJob(
                r.name,
                r.request,
                r.cpu_milli,
                r.memory_mib,
                a,
                round(min(timing.max_run, max(timing.min_run, r.lifetime * k)), 3),
            )
            for r, a in zip(ordered, arrivals, strict=True)
        ]

    lo_t, hi_t = timing.window_from * arrivals[-1], arrivals[-1]
    capacity = gpus * (hi_t - lo_t)

    def load(k: float) -> float:
        return _demand_integral(build(k), lo_t, hi_t) / capacity if capacity > 0 else 0.0

    # The offered load never falls as lifetimes grow: bisect on log k.
    lo, hi = 1e-6, 1e6
    if load(hi) < timing.load:
        return build(hi), hi  # even the longest lifetimes do not offer that much
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if load(mid) < timing.load:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.0001:
            break
    return build(hi), hi


# ---------------------------------------------------------------------------------------------
# The Alibaba trace


def trace_nodes(nodes: Sequence[TraceNode], count: int) -> tuple[NodeSpec, ...]:
    """``count`` nodes spread over the trace's node list (so the model mix is kept)."""
    return tuple(
        NodeSpec(n.name, catalogue_model(n.model).key, n.gpus, n.cpu_milli, n.memory_mib)
        for n in select_nodes(nodes, count)
        if n.gpus > 0
    )


def trace_workload(
    name: str,
    tasks: Sequence[TraceTask],
    all_nodes: Sequence[TraceNode],
    *,
    node_count: int,
    timing: Timing,
    seed: int,
) -> Workload:
    """A contiguous stretch of ``timing.jobs`` GPU tasks, starting where ``seed`` says.

    Tasks keep their order, their cpu and memory, and (when the file has them) their arrival
    gaps and lifetimes (``creation_time``, ``deletion_time``), both then rescaled as the module
    docstring says. A file without times gets Poisson arrivals in file order and exponential
    lifetimes (mean 1 before scaling), drawn from ``seed``. Tasks no node of the fleet could
    ever take (a ``gpu_spec`` naming models the fleet lacks, more GPUs than any node has) are
    left out before the stretch is cut, and counted in the notes."""
    nodes = trace_nodes(all_nodes, node_count)
    models = sorted({n.model for n in nodes})
    most = {m: max(n.gpus for n in nodes if n.model == m) for m in models}
    rng = random.Random(seed)
    mapped: list[tuple[TraceTask, MappedRequest]] = []
    left_out = 0
    for t in tasks:
        request = map_task(t, models)
        if request is None:
            continue
        if not request.models or request.count > max(most[m] for m in request.models):
            left_out += 1
            continue
        mapped.append((t, request))
    timed_tasks = [(t, r) for t, r in mapped if t.creation is not None and t.deletion is not None]
    with_times = len(timed_tasks) >= timing.jobs
    pool = (
        sorted(timed_tasks, key=lambda p: (p[0].creation or 0, p[0].name)) if with_times else mapped
    )
    if len(pool) < timing.jobs:
        raise ValueError(f"{name}: only {len(pool)} GPU tasks fit this fleet; asked {timing.jobs}")
    start = rng.randrange(len(pool) - timing.jobs + 1)
    stretch = pool[start : start + timing.jobs]
    raw: list[RawJob] = []
    clock = 0.0
    for i, (task, request) in enumerate(stretch):
        if with_times:
            assert task.creation is not None and task.deletion is not None
            arrival, life = float(task.creation), float(max(0, task.deletion - task.creation))
        else:
            clock += rng.expovariate(1.0)
            arrival, life = clock, rng.expovariate(1.0)
        raw.append(
            RawJob(
                f"j{i:05d}", request, max(1, task.cpu_milli), max(1, task.memory_mib), arrival, life
            )
        )
    gpus = sum(n.gpus for n in nodes)
    jobs, k = timed(raw, gpus, timing)
    times = (
        "trace arrival gaps and lifetimes"
        if with_times
        else "no times in the file: Poisson arrivals, exponential lifetimes"
    )
    description = (
        f"{name}: tasks {start}-{start + timing.jobs - 1} of {len(pool)} "
        f"({times}, seed {seed}); "
        f"{len(nodes)} trace nodes spread over the node list, {gpus} GPUs; "
        f"mapping: {MAPPING_TEXT}"
    )
    notes = (
        (f"{left_out} tasks no node of this fleet could take were left out",) if left_out else ()
    )
    return Workload(name, description, nodes, tuple(jobs), k, timing.window_from, notes)


def describe(workload: Workload, timing: Timing) -> list[str]:
    """Lines that say what the run replays (printed at its head)."""
    lo, hi = workload.window
    start = saturation_start(workload.jobs, workload.gpus)
    per_model: dict[str, int] = {}
    for n in workload.nodes:
        per_model[n.model] = per_model.get(n.model, 0) + n.gpus
    share = sum(j.request.share for j in workload.jobs)
    lives = sorted(j.lifetime for j in workload.jobs)
    classes = ", ".join(f"{c} {n}" for c, n in workload.by_class().items())
    return [
        workload.description,
        f"fleet: {len(workload.nodes)} nodes, {workload.gpus} GPUs ("
        + ", ".join(f"{m} {g}" for m, g in sorted(per_model.items()))
        + ")",
        f"jobs: {len(workload.jobs)} ({classes}), offered GPU share {share:.0f}; arrivals over "
        f"{workload.last_arrival:.0f}s ({timing.rate:g}/s); "
        f"lifetimes x{workload.lifetime_factor:.4g} "
        f"within [{timing.min_run:g}, {timing.max_run:g}]s, median {lives[len(lives) // 2]:.1f}s, "
        f"max {lives[-1]:.0f}s",
        f"window: {lo:.0f}s-{hi:.0f}s, offered load over it {workload.offered_load():.2f} "
        "(offered demand first reaches the GPU count "
        + ("never" if start is None else f"at {start:.0f}s")
        + ")",
        *workload.notes,
    ]
