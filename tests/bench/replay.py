"""Replay a trace (tests.bench.alibaba) through carve's engine and through the real allocator.

Both see the same cluster (one :class:`~controller.model.ClusterModel` each, built from the
trace's nodes) and the same jobs in the same order; every job's claim is the same
``ResourceClaim`` spec (:func:`tests.bench.alibaba.claim_spec`), parsed by carve's own parser
for carve and handed as JSON to kube-scheduler's allocator for the baseline.

- **carve** (:class:`CarveScheduler`): ``PlacementEngine.place`` with a packing policy, then
  ``commit``, as the controller does;
- **the real baseline** (:class:`RealScheduler`): kube-scheduler's structured allocator
  (``dra-allocate``, k8s.io/dynamic-resource-allocation v0.37.2) picks the devices on a node,
  through :class:`tests.support.real_allocator.CachedAllocator`. The node is the first, in name
  order, that passes node fit (cpu, memory, pods: kube-scheduler's NodeResourcesFit filter)
  and whose GPUs ``driver.geometry`` says can take the request (the allocator agrees with the
  geometry on every fit, tests/cluster/test_real_allocator.py; a disagreement is counted and
  the next node tried). Name order is the packing-friendly choice: kube-scheduler's default
  scoring (LeastAllocated on cpu and memory) would spread pods over nodes instead, which only
  fragments GPUs more, so the baseline here is the allocator at its best.

Two ways to run a trace (:func:`build_jobs`):

- ``saturation`` (the FGD paper's method): tasks arrive in trace order and never leave, until
  the offered GPU share reaches ``load`` x the cluster's GPUs (the list is cycled if it is too
  short). Failed tasks are dropped (no queue), so ``placed`` isolates the packing decisions;
- ``timeline``: arrivals at ``creation_time`` and departures at ``deletion_time``; arrival gaps
  are divided by ``speedup`` (lifetimes kept), which multiplies the offered load.
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.claims import ClaimHold, ClaimKey, DeviceClass, parse_claim_spec
from controller.model import ClusterModel, GpuRecord
from controller.nodefit import NodeInfo, PodNeeds, Resources, check_node
from controller.placement import ClaimToPlace, NoPlacement, PlacementEngine, PlacementRequest
from controller.placement.scoring import Policy
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from tests.bench.alibaba import (
    DRIVER,
    GPU_CLASS,
    MIG_CLASS,
    MappedRequest,
    TraceNode,
    TraceTask,
    catalogue_model,
    claim_spec,
    map_task,
)
from tests.support.cluster_builders import build_gpu
from tests.support.real_allocator import CachedAllocator

_ATTR = f'device.attributes["{DRIVER}"]'
CLASSES = {
    MIG_CLASS: DeviceClass(MIG_CLASS, (f'{_ATTR}.type == "mig"',)),
    GPU_CLASS: DeviceClass(GPU_CLASS, (f'{_ATTR}.type == "gpu"',)),
}
PODS_PER_NODE = 110
_MIB = 2**20


# ---------------------------------------------------------------------------------------------
# Cluster and jobs


def select_nodes(nodes: Sequence[TraceNode], count: int | None) -> list[TraceNode]:
    """``count`` nodes spread evenly over the node list (which is grouped by model), so a
    subset keeps the model mix; all of them for None."""
    if count is None or count >= len(nodes):
        return list(nodes)
    step = len(nodes) / count
    return [nodes[int(i * step)] for i in range(count)]


def build_model(nodes: Sequence[TraceNode]) -> ClusterModel:
    model = ClusterModel()
    for n in nodes:
        model.set_node(
            NodeInfo(
                n.name,
                Resources(n.cpu_milli, n.memory_mib * _MIB, PODS_PER_NODE),
                labels=(("kubernetes.io/hostname", n.name),),
            )
        )
        gpu = catalogue_model(n.model)
        model.set_node_gpus(n.name, [build_gpu(n.name, m, gpu, DRIVER) for m in range(n.gpus)])
    return model


def cluster_gpus(nodes: Sequence[TraceNode]) -> int:
    return sum(n.gpus for n in nodes)


@dataclass(frozen=True)
class Job:
    pod: str
    task: TraceTask | None  # None for a synthetic job (bench/packing.py)
    request: MappedRequest
    spec: Mapping[str, Any]  # the ResourceClaim spec
    needs: PodNeeds
    arrival: float
    departure: float | None  # None: never leaves


def build_jobs(
    tasks: Sequence[TraceTask],
    nodes: Sequence[TraceNode],
    *,
    mode: str = "saturation",
    load: float = 1.0,
    limit: int | None = None,
    speedup: float = 1.0,
) -> list[Job]:
    """The jobs of one replay; see the module docstring for the two modes."""
    models = sorted({catalogue_model(n.model).key for n in nodes})
    specs: dict[MappedRequest, Mapping[str, Any]] = {}

    def job(task: TraceTask, pod: str, arrival: float, departure: float | None) -> Job | None:
        request = map_task(task, models)
        if request is None or not request.models:
            return None
        spec = specs.setdefault(request, claim_spec(request))
        needs = PodNeeds(Resources(task.cpu_milli, task.memory_mib * _MIB, 1))
        return Job(pod, task, request, spec, needs, arrival, departure)

    jobs: list[Job] = []
    if mode == "saturation":
        target = load * cluster_gpus(nodes)
        offered = 0.0
        gpu_tasks = [(i, t) for i, t in enumerate(tasks) if t.num_gpu > 0]
        if not gpu_tasks:
            return []
        # A cluster smaller than the trace's takes every k-th task (then every k-th from the
        # next offset, ...), so that it sees the whole trace's mix, not only its beginning.
        total = sum(m.share for _, t in gpu_tasks if (m := map_task(t, models)) is not None)
        stride = max(1, int(total / target)) if target else 1
        order = [gpu_tasks[k] for o in range(stride) for k in range(o, len(gpu_tasks), stride)]
        for n, (_, task) in enumerate(itertools.cycle(order)):
            if offered >= target or (limit is not None and len(jobs) >= limit):
                break
            rnd = n // len(order)
            j = job(task, task.name if rnd == 0 else f"{task.name}.{rnd}", float(n), None)
            if j is not None:
                jobs.append(j)
                offered += j.request.share
        return jobs
    if mode != "timeline":
        raise ValueError(f"mode must be saturation or timeline, not {mode!r}")
    timed = [t for t in tasks if t.creation is not None and t.deletion is not None]
    if not timed:
        raise ValueError("timeline mode needs creation_time and deletion_time columns")
    timed.sort(key=lambda t: (t.creation or 0, t.name))
    t0 = timed[0].creation or 0
    for task in timed:
        assert task.creation is not None and task.deletion is not None
        arrival = t0 + (task.creation - t0) / speedup
        j = job(task, task.name, arrival, arrival + max(0, task.deletion - task.creation))
        if j is not None:
            jobs.append(j)
        if limit is not None and len(jobs) >= limit:
            break
    return jobs


# ---------------------------------------------------------------------------------------------
# Schedulers


class Scheduler(abc.ABC):
    """Places one job on the model (and records it there), or says it cannot."""

    name = ""

    @abc.abstractmethod
    def place(self, model: ClusterModel, job: Job) -> bool: ...


class CarveScheduler(Scheduler):
    def __init__(self, model: ClusterModel, policy: Policy) -> None:
        self.name = f"carve {policy.value}"
        self.engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
        self._specs: dict[int, Any] = {}

    def request(self, job: Job) -> PlacementRequest:
        """The job as the engine sees it: one claim, parsed by carve's own parser."""
        spec = self._specs.get(id(job.spec))
        if spec is None:
            spec = self._specs[id(job.spec)] = parse_claim_spec(job.spec, DRIVER)
        claim = ClaimToPlace(ClaimKey("trace", job.pod, job.pod), spec)
        return PlacementRequest(job.pod, job.needs, (claim,))

    def place(self, model: ClusterModel, job: Job) -> bool:
        result = self.engine.place(self.request(job))
        if isinstance(result, NoPlacement):
            return False
        self.engine.commit(result, job.pod, job.needs)
        return True


class RealScheduler(Scheduler):
    """kube-scheduler's allocator on the first node that passes node fit and geometry."""

    name = "kube-scheduler allocator"

    def __init__(self, allocator: CachedAllocator, upcoming: Callable[[], Sequence[Job]]) -> None:
        self.allocator = allocator
        self.upcoming = upcoming
        self.disagreements = 0
        self._node_order: list[str] | None = None
        self._ids: dict[MappedRequest, Mapping[str, int]] = {}

    def place(self, model: ClusterModel, job: Job) -> bool:
        if self._node_order is None:
            self._node_order = sorted(model.gpu_nodes())
        ids = self._ids.get(job.request)
        if ids is None:
            ids = self._ids[job.request] = _profile_ids(job.request)
        for node in self._node_order:
            gpus = model.gpus_on(node)
            if not _geometry_fits(gpus, job.request, ids):
                continue
            if check_node(job.needs, model.nodes[node], model.node_usage(node)) is not None:
                continue
            held = frozenset(
                g.by_placement[key].name for g in gpus for key in g.holders if g.holders[key]
            )
            also = {id(j.spec): j.spec for j in self.upcoming()}
            devices = self.allocator.allocate(
                [g.inventory.model for g in gpus], held, job.spec, also.values()
            )
            if devices is None:
                self.disagreements += 1
                continue
            claim = ClaimKey("trace", job.pod, job.pod)
            pool = gpus[0].inventory.pool
            model.hold(
                ClaimHold(
                    claim, node, tuple(AllocatedDevice("gpu", DRIVER, pool, d) for d in devices)
                )
            )
            model.set_pod(job.pod, node, job.needs.requests)
            return True
        return False


def _profile_ids(request: MappedRequest) -> Mapping[str, int]:
    """Model key -> the profile id the request asks for there (MIG requests)."""
    return {
        key: next(p.id for p in gpu_model(key).profiles if p.name == name)
        for key, name in request.profiles
    }


def _geometry_fits(
    gpus: Sequence[GpuRecord], request: MappedRequest, ids: Mapping[str, int]
) -> bool:
    if request.whole:
        free = 0
        for g in gpus:
            if not g.occupancy.in_use and g.inventory.model.key in request.models:
                free += 1
                if free >= request.count:
                    return True
        return False
    for g in gpus:
        pid = ids.get(g.inventory.model.key)
        if pid is None or g.occupancy.blocked:
            continue
        if g.geometry.feasible_starts(g.occupancy.state, pid):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# The replay loop and its figures


@dataclass
class Figures:
    name: str
    jobs: int = 0
    placed: int = 0
    share_asked: float = 0.0
    share_placed: float = 0.0
    failures: int = 0
    frag_failures: int = 0  # failed while the cluster's free GPU share covered the request
    utilization: float = 0.0  # at the end (saturation) or averaged after warm-up (timeline)
    fragmentation: float = 0.0
    series: list[tuple[int, float]] = field(default_factory=list)  # (jobs seen, utilization)
    seconds: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    by_shape: dict[str, list[int]] = field(default_factory=dict)  # shape -> [asked, placed]
    notes: str = ""

    @property
    def placed_fraction(self) -> float:
        return self.placed / self.jobs if self.jobs else 0.0

    @property
    def share_fraction(self) -> float:
        return self.share_placed / self.share_asked if self.share_asked else 0.0


def gpu_utilization(model: ClusterModel) -> float:
    """Occupied memory slices as a share of each GPU, averaged over all GPUs."""
    used = total = 0.0
    for record in model.gpus.values():
        units = record.inventory.model.memory_units
        occ = record.occupancy
        used += 1.0 if occ.blocked else occ.state.occupied.bit_count() / units
        total += 1
    return used / total if total else 0.0


def _free_share(model: ClusterModel, models: Sequence[str], per_model: Mapping[str, int]) -> float:
    return sum((1 - model.utilization(k)) * per_model.get(k, 0) for k in models)


def fragmentation(model: ClusterModel) -> float:
    """1 - sum(size of the largest profile still creatable) / sum(free units), over GPUs."""
    free = usable = 0
    for record in model.gpus.values():
        occ = record.occupancy
        if occ.blocked:
            continue
        gm = record.inventory.model
        busy = occ.state.occupied.bit_count()
        free += gm.memory_units - busy
        if not occ.state.instances:
            usable += gm.memory_units
            continue
        largest = 0
        for pid, n in record.geometry.admits(occ.state).items():
            if n:
                largest = max(largest, gm.profile_by_id(pid).size)
        usable += largest
    return (1 - usable / free) if free else 0.0


MakeScheduler = Callable[[ClusterModel, Callable[[], Sequence[Job]]], Scheduler]


def replay(
    model: ClusterModel,
    jobs: Sequence[Job],
    make: MakeScheduler,
    *,
    samples: int = 20,
    lookahead: int = 40,
    warmup: float = 0.2,
) -> Figures:
    """One scheduler over the jobs on ``model`` (a fresh cluster, :func:`build_model`, which
    the replay fills); ``make(model, upcoming)`` builds the scheduler (``upcoming()`` are the
    next ``lookahead`` jobs, for the baseline's prefetch)."""
    position = 0

    def upcoming() -> Sequence[Job]:
        return jobs[position : position + lookahead]

    scheduler = make(model, upcoming)
    figures = Figures(scheduler.name)
    before = (
        dataclasses.replace(scheduler.allocator.stats)
        if isinstance(scheduler, RealScheduler)
        else None
    )
    per_model: dict[str, int] = {}
    for r in model.gpus.values():
        per_model[r.inventory.model.key] = per_model.get(r.inventory.model.key, 0) + 1
    live: list[tuple[float, str]] = []
    times: list[float] = []
    every = max(1, len(jobs) // samples)
    timeline = any(j.departure is not None for j in jobs)
    util_samples: list[float] = []
    for position, job in enumerate(jobs):
        while live and live[0][0] <= job.arrival:
            _, pod = heapq.heappop(live)
            model.release(ClaimKey("trace", pod, pod))
            model.remove_pod(pod)
        t0 = time.perf_counter()
        ok = scheduler.place(model, job)
        times.append(time.perf_counter() - t0)
        figures.jobs += 1
        figures.share_asked += job.request.share
        counts = figures.by_shape.setdefault(job.request.shape, [0, 0])
        counts[0] += 1
        if ok:
            figures.placed += 1
            figures.share_placed += job.request.share
            counts[1] += 1
            if job.departure is not None:
                heapq.heappush(live, (job.departure, job.pod))
        else:
            figures.failures += 1
            if _free_share(model, job.request.models, per_model) >= job.request.share - 1e-9:
                figures.frag_failures += 1
        if (position + 1) % every == 0 or position + 1 == len(jobs):
            u = gpu_utilization(model)
            figures.series.append((position + 1, u))
            if position >= warmup * len(jobs):
                util_samples.append(u)
    figures.utilization = (
        statistics.fmean(util_samples)
        if timeline and util_samples
        else (figures.series[-1][1] if figures.series else 0.0)
    )
    figures.fragmentation = fragmentation(model)
    figures.seconds = sum(times)
    ordered = sorted(times)
    if ordered:
        figures.p50_ms = ordered[len(ordered) // 2] * 1000
        figures.p99_ms = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    if isinstance(scheduler, RealScheduler) and before is not None:
        s = scheduler.allocator.stats
        figures.notes = (
            f"{s.runs - before.runs} dra-allocate runs ({s.steps - before.steps} steps, "
            f"{s.seconds - before.seconds:.1f}s), {s.hits - before.hits} cached answers, "
            f"{scheduler.disagreements} geometry disagreements"
        )
    return figures


def carve(policy: Policy) -> MakeScheduler:
    def make(model: ClusterModel, upcoming: Callable[[], Sequence[Job]]) -> Scheduler:
        return CarveScheduler(model, policy)

    return make


def real(allocator: CachedAllocator) -> MakeScheduler:
    def make(model: ClusterModel, upcoming: Callable[[], Sequence[Job]]) -> Scheduler:
        return RealScheduler(allocator, upcoming)

    return make


# ---------------------------------------------------------------------------------------------
# Bounds


@dataclass(frozen=True)
class Bound:
    share: float  # most GPU share any policy could place
    jobs: int  # most jobs any policy could place
    utilization: float


def fluid_bound(nodes: Sequence[TraceNode], jobs: Sequence[Job]) -> Bound:
    """Every memory slice of every GPU usable by any request (no geometry, no node, no cpu),
    and no departures counted as free room: min(offered, capacity) for the share, the most
    jobs whose shares fit the capacity (smallest first) for the count. Valid for saturation
    runs; a timeline run's bound would need the concurrency profile."""
    capacity = float(cluster_gpus(nodes))
    shares = sorted(j.request.share for j in jobs)
    total = sum(shares)
    count = 0
    acc = 0.0
    for s in shares:
        if acc + s > capacity + 1e-9:
            break
        acc += s
        count += 1
    placed = min(total, capacity)
    return Bound(placed, count, placed / capacity if capacity else 0.0)
