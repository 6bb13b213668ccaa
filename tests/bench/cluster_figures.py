"""The figures of one arm of ``python -m bench.cluster_packing``, from what the run recorded.

Pure: an arm records, per job, when its pod was created, when it was bound and where, which
devices its claim got, and when the bench deleted it (:class:`JobRecord`, wall seconds from the
arm's start, the clock the arrivals use). Everything below is computed from those records and
the workload, after the run, so measuring costs the run no
CPU. Definitions (also printed under the table):

- **share**: the GPU share held by running jobs (bound, not yet deleted), averaged over the
  window (``Workload.window``: the stretch of the arrivals, fixed by the workload alone and the
  same for every arm, over which the offered load is set; it leaves the fill out), as a
  fraction of the fleet's GPUs.
  A job's share is its size on an 8-slice GPU or its number of whole GPUs
  (``MappedRequest.share``), whichever model it lands on;
- **jobs**: the fraction of all jobs whose pod was bound before the arm ended; **by horizon**:
  bound by the last arrival;
- **util**: memory slices held (a whole GPU holds all of its own), over all memory slices of
  each GPU, averaged over the GPUs and over samples of the window;
- **waits**: bound - created, per size class (``cluster_workload.SIZE_CLASSES``), p50 and p99
  (nearest rank); a job never bound counts with the time it had waited when the arm ended, a
  lower bound, and the row says how many such jobs there were; **large** is 7g and multi-GPU
  together, and **max large** the longest wait of one;
- **frag**: the free GPU share on nodes that cannot host the largest waiting request (by share,
  then the earliest; node fit: its GPUs' free placements, cpu and memory), as a fraction of the
  fleet's GPUs, averaged over the window's samples (0 when nothing waits);
- **bound**: at each sample of the window, the most GPU share the fleet could hold with the jobs
  present then (running or waiting): the smaller of the fluid bound (all of it, up to the GPU
  count) and the configuration LP (``tests.bench.bounds``: MIG geometry per model, cpu and
  memory per model, any arrival order, fractional jobs), averaged. **/bound** is the share held
  at the same samples, averaged, over it (so both are sampled alike).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from controller.claims import ClaimHold, ClaimKey
from controller.model import ClusterModel, GpuRecord
from controller.nodefit import NodeInfo, Resources
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from tests.bench.alibaba import DRIVER, MappedRequest
from tests.bench.bounds import ModelCapacity, configuration_lp, demand_of
from tests.bench.cluster_workload import (
    LARGE_CLASSES,
    SIZE_CLASSES,
    NodeSpec,
    TimedJob,
    Workload,
)
from tests.bench.queued import percentile
from tests.support.cluster_builders import build_gpu

_MIB = 2**20


@dataclass(frozen=True)
class JobRecord:
    """What the run saw of one job; times in wall seconds from the arm's start."""

    name: str
    created: float  # the pod's create call returned
    bound: float | None = None  # spec.nodeName seen
    node: str = ""
    devices: tuple[AllocatedDevice, ...] = ()  # from the claim's status.allocation
    ended: float | None = None  # the bench deleted the pod (bound + lifetime)


@dataclass(frozen=True)
class ClassWaits:
    jobs: int
    p50: float
    p99: float
    unplaced: int  # never bound: their waits are lower bounds


@dataclass(frozen=True)
class ArmFigures:
    arm: str
    jobs: int
    placed: int  # bound before the arm ended
    placed_by_horizon: int
    share: float
    util: float
    frag: float
    bound: float
    of_bound: float  # the share at the bound's samples over the bound
    fluid: float
    waits: Mapping[str, ClassWaits]
    large: ClassWaits
    max_large_wait: float
    end: float  # the arm's end, seconds from its start
    notes: tuple[str, ...] = field(default=())

    @property
    def placed_fraction(self) -> float:
        return self.placed / self.jobs if self.jobs else 0.0

    def summary_line(self) -> str:
        """The line every run ends with, one per arm."""
        return (
            f"arm={self.arm} share={self.share:.4f} jobs={self.placed_fraction:.4f} "
            f"large_p99_wait_s={self.large.p99:.1f}"
        )


def ceiling(carve: ArmFigures, peer: ArmFigures) -> float:
    """The most GPU share any packer could have held over the peer on these jobs: carve's
    bound over the peer's share. A share target above it could not be met in this run by any
    policy, which is worth saying next to a ratio that misses one."""
    return carve.bound / peer.share if peer.share else math.nan


def headroom_closed(carve: ArmFigures, peer: ArmFigures) -> float:
    """How much of the peer's room below the bound carve took: 1 for a perfect packer, 0 for
    no better than the peer, below 0 for worse. Unlike a ratio, it does not move with how close
    the peer happened to come to the bound on a stretch of jobs."""
    room = carve.bound - peer.share
    return (carve.share - peer.share) / room if room > 0 else math.nan


def fleet_model(nodes: Sequence[NodeSpec]) -> ClusterModel:
    """The fleet in carve's model, with no holds: each node's cpu and memory, and its GPUs as
    ``tests.support.cluster_builders.build_gpu`` publishes them (device names are the ones the
    fleet's ResourceSlices carry, so a claim's allocation results name them; the catalogue
    model keeps its catalogue key, which the jobs' requests name)."""
    model = ClusterModel()
    for n in nodes:
        model.set_node(
            NodeInfo(
                n.name,
                Resources(n.cpu_milli, n.memory_mib * _MIB, 110),
                labels=(("kubernetes.io/hostname", n.name),),
            )
        )
        gpu = gpu_model(n.model)
        model.set_node_gpus(n.name, [build_gpu(n.name, m, gpu, DRIVER) for m in range(n.gpus)])
    return model


def _free_units(record: GpuRecord) -> int:
    occ = record.occupancy
    if occ.blocked:
        return 0
    return record.inventory.model.memory_units - occ.state.occupied.bit_count()


def _gpu_share_free(record: GpuRecord) -> float:
    return _free_units(record) / record.inventory.model.memory_units


def _hosts(
    model: ClusterModel, node: str, request: MappedRequest, cpu: float, memory: float
) -> bool:
    """Could ``node`` take a job with this request now (GPUs, cpu, memory)?"""
    info = model.nodes[node]
    used = model.node_usage(node)
    if info.allocatable.cpu_milli - used.cpu_milli < cpu:
        return False
    if info.allocatable.memory - used.memory < memory * _MIB:
        return False
    gpus = [g for g in model.gpus_on(node) if g.inventory.model.key in request.models]
    if request.whole:
        return sum(1 for g in gpus if not g.occupancy.in_use) >= request.count
    for g in gpus:
        name = request.profile_on(g.inventory.model.key)
        if name is None or g.occupancy.blocked:
            continue
        pid = next(p.id for p in g.inventory.model.profiles if p.name == name)
        if g.geometry.feasible_starts(g.occupancy.state, pid):
            return True
    return False


def _utilization(model: ClusterModel) -> float:
    used = total = 0.0
    for record in model.gpus.values():
        units = record.inventory.model.memory_units
        used += (units - _free_units(record)) / units
        total += 1
    return used / total if total else 0.0


def _waits(values: Sequence[float], unplaced: int) -> ClassWaits:
    return ClassWaits(len(values), percentile(values, 0.50), percentile(values, 0.99), unplaced)


def arm_figures(
    arm: str,
    workload: Workload,
    records: Mapping[str, JobRecord],
    model: ClusterModel,
    end: float,
    *,
    sample_s: float = 5.0,
) -> ArmFigures:
    """The arm's figures (module docstring). ``model``: :func:`fleet_model`, with no holds;
    it is filled and emptied here. ``end``: when the arm stopped watching, from its start.
    The LP runs at every sample (it costs 0.1-0.3 s)."""
    jobs = {j.name: j for j in workload.jobs}
    gpus = workload.gpus
    lo, hi = workload.window
    horizon = workload.last_arrival

    # Waits, per class and for the large jobs.
    per_class: dict[str, list[float]] = {c: [] for c in SIZE_CLASSES}
    unplaced_per_class = dict.fromkeys(SIZE_CLASSES, 0)
    large: list[float] = []
    large_unplaced = 0
    placed = by_horizon = 0
    for job in workload.jobs:
        rec = records.get(job.name)
        created = rec.created if rec is not None else job.arrival
        if rec is not None and rec.bound is not None:
            wait = rec.bound - created
            placed += 1
            by_horizon += rec.bound <= horizon
        else:
            wait = max(0.0, end - created)
            unplaced_per_class[job.size_class] += 1
            large_unplaced += job.size_class in LARGE_CLASSES
        per_class[job.size_class].append(wait)
        if job.size_class in LARGE_CLASSES:
            large.append(wait)
    waits = {c: _waits(per_class[c], unplaced_per_class[c]) for c in SIZE_CLASSES}

    # Share over the window: exact, from the running intervals.
    held = 0.0
    for job in workload.jobs:
        rec = records.get(job.name)
        if rec is None or rec.bound is None:
            continue
        a, b = max(lo, rec.bound), min(hi, rec.ended if rec.ended is not None else end)
        if b > a:
            held += (b - a) * job.request.share
    share = held / ((hi - lo) * gpus) if hi > lo and gpus else 0.0

    # Samples: replay binds and ends in time order into the model.
    events: list[tuple[float, int, str]] = []  # (time, 0 end / 1 bind, job)
    for name, rec in records.items():
        if rec.bound is None or name not in jobs:
            continue
        events.append((rec.bound, 1, name))
        if rec.ended is not None:
            events.append((rec.ended, 0, name))
    events.sort()
    samples = _sample_times(lo, hi, sample_s)
    capacity = _capacity(workload.nodes)
    arrivals = sorted(workload.jobs, key=lambda j: j.arrival)
    utils: list[float] = []
    frags: list[float] = []
    bounds: list[float] = []
    fluids: list[float] = []
    held_samples: list[float] = []  # the share at each sample, to set against the bound
    running: set[str] = set()
    e = 0
    notes: list[str] = []
    for t in samples:
        while e < len(events) and events[e][0] <= t:
            _, kind, name = events[e]
            e += 1
            rec = records[name]
            key = ClaimKey("bench", name, name)
            if kind == 1:
                if rec.devices:
                    model.hold(ClaimHold(key, rec.node, rec.devices))
                job = jobs[name]
                model.set_pod(name, rec.node, Resources(job.cpu_milli, job.memory_mib * _MIB, 1))
                running.add(name)
            else:
                model.release(key)
                model.remove_pod(name)
                running.discard(name)
        waiting = [
            j
            for j in arrivals
            if j.arrival <= t
            and (
                (r := records.get(j.name)) is None
                or (r.created <= t and (r.bound is None or r.bound > t))
            )
        ]
        utils.append(_utilization(model))
        frags.append(_fragmentation(model, waiting) / gpus)
        present = [jobs[name] for name in running] + waiting
        held_samples.append(sum(jobs[name].request.share for name in running) / gpus)
        fluid = min(1.0, sum(j.request.share for j in present) / gpus)
        fluids.append(fluid)
        lp = configuration_lp(
            capacity, demand_of((j.request, j.cpu_milli, j.memory_mib) for j in present)
        )
        bounds.append(min(fluid, lp.share / gpus))
    for name in list(running):
        model.release(ClaimKey("bench", name, name))
        model.remove_pod(name)
    if model.problems:
        notes.append(f"{len(model.problems)} model problems (overlapping holds)")
    return ArmFigures(
        arm=arm,
        jobs=len(workload.jobs),
        placed=placed,
        placed_by_horizon=by_horizon,
        share=share,
        util=_mean(utils),
        frag=_mean(frags),
        bound=_mean(bounds),
        of_bound=_mean(held_samples) / _mean(bounds) if bounds and _mean(bounds) else math.nan,
        fluid=_mean(fluids),
        waits=waits,
        large=_waits(large, large_unplaced),
        max_large_wait=max(large, default=0.0),
        end=end,
        notes=tuple(notes),
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _sample_times(lo: float, hi: float, step: float) -> list[float]:
    if hi <= lo:
        return [hi]
    count = max(1, int((hi - lo) / step))
    return [lo + (i + 0.5) * (hi - lo) / count for i in range(count)]


def _capacity(nodes: Sequence[NodeSpec]) -> dict[str, ModelCapacity]:
    acc: dict[str, list[float]] = {}
    for n in nodes:
        a = acc.setdefault(n.model, [0, 0.0, 0.0])
        a[0] += n.gpus
        a[1] += n.cpu_milli
        a[2] += n.memory_mib
    return {m: ModelCapacity(int(a[0]), a[1], a[2]) for m, a in acc.items()}


def _fragmentation(model: ClusterModel, waiting: Sequence[TimedJob]) -> float:
    """Free GPU share on nodes that cannot host the largest waiting request."""
    if not waiting:
        return 0.0
    largest = max(waiting, key=lambda j: (j.request.share, -j.arrival))
    stuck = 0.0
    for node in model.gpu_nodes():
        free = sum(_gpu_share_free(g) for g in model.gpus_on(node))
        if free and not _hosts(model, node, largest.request, largest.cpu_milli, largest.memory_mib):
            stuck += free
    return stuck
