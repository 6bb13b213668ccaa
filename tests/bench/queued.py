"""The queued replay: jobs that do not fit wait, and are retried when capacity frees.

:func:`tests.bench.replay.replay` drops a job that does not fit on arrival, which isolates
packing decisions but says nothing about waiting. Here every job waits in a pending queue
until it is placed. The model (the same for every service, in trace time after the speed-up):

- events are arrivals (``creation_time``, gaps divided by the speed-up) and departures (a
  placed job leaves its lifetime, ``deletion_time - creation_time``, after it *started*, so
  waiting delays everything behind it, as on a real cluster);
- at each event time, departures first, then arrivals, then one scheduling pass. A pass after a
  departure retries the whole queue; a pass with arrivals only tries the new jobs (the others
  were refused on a cluster that had at least as much room, and a refusal does not turn into a
  fit when room is only taken);
- **in order** (:class:`InOrder`): the queue is served in arrival order, each job once per pass,
  a job that does not fit stays where it is and the next is tried. This is kube-scheduler's
  active queue with equal priorities: pods are popped in creation order (the default
  PrioritySort), an unschedulable pod goes to the unschedulable pool and back to the active
  queue on a cluster event that may make it schedulable (here: any departure), and no pod
  blocks the ones behind it. Backoff timers and the 5-minute flush are not modelled: every
  departure retries every waiting pod at once, which favours the baseline (no pod waits for
  a backoff to expire). carve's reconciler serves its queue the same way (priority, then
  creation time), so carve's policies run in this service as well;
- **joint** (:class:`Joint`): carve's :class:`~tests.bench.queue_placer.QueuePlacer` on the
  queue, the job's GPU share as its weight, with the starvation guard for jobs of
  ``LARGE_SHARE`` GPUs or more after ``keep_after`` seconds of waiting;
- the trace's horizon is its last arrival: *placed* counts jobs placed by then, as in the
  unqueued replay; the replay goes on until no departure is left, so that every job that fits
  at all is placed eventually and its queueing delay (start - arrival) is known. Jobs that no
  node could ever take are counted apart.
"""

from __future__ import annotations

import abc
import heapq
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from controller.claims import ClaimKey
from controller.model import ClusterModel
from controller.placement import Placement, PlacementRequest, Policy
from tests.bench.queue_placer import QueuePlacer, Waiting
from tests.bench.replay import (
    CarveScheduler,
    Figures,
    Job,
    RealScheduler,
    Scheduler,
    fragmentation,
    gpu_utilization,
)
from tests.support.real_allocator import CachedAllocator

LARGE_SHARE = 2.0
"""Jobs of at least this GPU share (multi-GPU pods) are the ones that starve: their waits are
reported apart."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class QueueService(abc.ABC):
    """One scheduling pass over the pending queue; records what it places in the model."""

    name = ""
    decisions = 0  # engine or allocator decisions made, over all passes

    @abc.abstractmethod
    def serve(
        self, model: ClusterModel, queue: Sequence[Job], fresh: int, freed: bool, now: float
    ) -> list[Job]:
        """Jobs placed in this pass. ``queue`` is in arrival order; its last ``fresh`` jobs
        arrived at ``now``; ``freed`` says a departure happened since the last pass."""


def _shape(job: Job) -> tuple[object, ...]:
    return (job.request, job.needs)


class InOrder(QueueService):
    """Arrival order, each job once per pass; see the module docstring."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.name = scheduler.name

    def serve(
        self, model: ClusterModel, queue: Sequence[Job], fresh: int, freed: bool, now: float
    ) -> list[Job]:
        candidates = queue if freed else queue[len(queue) - fresh :]
        placed: list[Job] = []
        failed: set[tuple[object, ...]] = set()
        for job in candidates:
            shape = _shape(job)
            if shape in failed:
                continue  # the same request was refused earlier in this pass, on more room
            self.decisions += 1
            if self.scheduler.place(model, job):
                placed.append(job)
            else:
                failed.add(shape)
        return placed


class Joint(QueueService):
    """carve's joint placement of the queue, with the starvation guard."""

    def __init__(
        self,
        model: ClusterModel,
        policy: Policy,
        *,
        window: int,
        keep_after: float | None,
        budget_s: float = 0.05,
    ) -> None:
        self.carve = CarveScheduler(model, policy)
        self.placer = QueuePlacer(
            self.carve.engine,
            window=window,
            keep_after=keep_after,
            keep_min_weight=LARGE_SHARE,
            budget_s=budget_s,
        )
        guard = f", keep after {keep_after:g}s" if keep_after is not None else ""
        self.name = f"carve {policy.value} joint{guard}"
        self.orders = 0
        self.gained = 0.0  # weight placed beyond the queue order's, over all passes
        self._requests: dict[str, PlacementRequest] = {}

    def _waiting(self, job: Job) -> Waiting:
        request = self._requests.get(job.pod)
        if request is None:
            request = self._requests[job.pod] = self.carve.request(job)
        return Waiting(request, job.arrival, job.request.share)

    def serve(
        self, model: ClusterModel, queue: Sequence[Job], fresh: int, freed: bool, now: float
    ) -> list[Job]:
        by_pod = {job.pod: job for job in queue}
        engine = self.carve.engine
        if not freed:
            placed = []
            for job in queue[len(queue) - fresh :]:
                self.decisions += 1
                result = self.placer.place_one(self._waiting(job))
                if isinstance(result, Placement):
                    engine.commit(result, job.pod, job.needs)
                    placed.append(job)
            return placed
        waiting = [self._waiting(job) for job in queue]
        before = self.placer.decisions
        plan = self.placer.plan(waiting, now)
        self.decisions += self.placer.decisions - before
        self.orders += plan.orders_tried
        self.gained += plan.weight - plan.queue_order_weight
        out = []
        for pod, placement in plan.placements:
            job = by_pod[pod]
            engine.commit(placement, pod, job.needs)
            out.append(job)
            self._requests.pop(pod, None)
        return out


MakeService = Callable[[ClusterModel, Callable[[], Sequence[Job]]], QueueService]


def in_order(make: Callable[[ClusterModel, Callable[[], Sequence[Job]]], Scheduler]) -> MakeService:
    def build(model: ClusterModel, upcoming: Callable[[], Sequence[Job]]) -> QueueService:
        return InOrder(make(model, upcoming))

    return build


def joint(policy: Policy, *, window: int = 12, keep_after: float | None = None) -> MakeService:
    def build(model: ClusterModel, upcoming: Callable[[], Sequence[Job]]) -> QueueService:
        return Joint(model, policy, window=window, keep_after=keep_after)

    return build


@dataclass
class QueuedFigures(Figures):
    wait_p50: float = 0.0  # queueing delay of the jobs placed (at any time), trace seconds
    wait_p99: float = 0.0
    wait_mean: float = 0.0
    large_wait_p99: float = 0.0  # the same for jobs of LARGE_SHARE GPUs or more
    large_wait_max: float = 0.0
    waited: int = 0  # jobs that did not start on arrival
    never: int = 0  # jobs never placed, even after every departure
    never_pods: tuple[str, ...] = ()
    wait_of: dict[str, float] = field(default_factory=dict)  # pod -> queueing delay
    decisions: int = 0
    passes: int = 0
    pass_p99_ms: float = 0.0


def replay_queued(
    model: ClusterModel,
    jobs: Sequence[Job],
    make: MakeService,
    *,
    samples: int = 400,
    warmup: float = 0.2,
    lookahead: int = 40,
) -> QueuedFigures:
    """One service over the jobs (arrival order, departures set) on a fresh ``model``."""
    if any(j.departure is None for j in jobs):
        raise ValueError("the queued replay needs departures (timeline mode)")
    jobs = sorted(jobs, key=lambda j: j.arrival)
    position = 0

    def upcoming() -> Sequence[Job]:
        return jobs[position : position + lookahead]

    service = make(model, upcoming)
    scheduler = service.scheduler if isinstance(service, InOrder) else None
    allocator_before = (
        _copy_stats(scheduler.allocator) if isinstance(scheduler, RealScheduler) else None
    )
    figures = QueuedFigures(service.name)
    horizon = jobs[-1].arrival if jobs else 0.0
    start_t = jobs[0].arrival if jobs else 0.0
    warm_from = start_t + warmup * (horizon - start_t)
    sample_every = max(1, 2 * len(jobs) // samples)
    per_model: dict[str, int] = {}
    for r in model.gpus.values():
        per_model[r.inventory.model.key] = per_model.get(r.inventory.model.key, 0) + 1
    pending: list[Job] = []
    live: list[tuple[float, str]] = []
    waits: list[float] = []
    large_waits: list[float] = []
    pass_times: list[float] = []
    util_all: list[float] = []
    util_saturated: list[float] = []
    events = 0
    while position < len(jobs) or (pending and live):
        t_arrival = jobs[position].arrival if position < len(jobs) else math.inf
        now = min(t_arrival, live[0][0] if live else math.inf)
        freed = False
        while live and live[0][0] <= now:
            _, pod = heapq.heappop(live)
            model.release(ClaimKey("trace", pod, pod))
            model.remove_pod(pod)
            freed = True
        fresh = 0
        while position < len(jobs) and jobs[position].arrival <= now:
            job = jobs[position]
            pending.append(job)
            figures.jobs += 1
            figures.share_asked += job.request.share
            fresh += 1
            position += 1
        t0 = time.perf_counter()
        placed = service.serve(model, pending, fresh, freed, now)
        pass_times.append(time.perf_counter() - t0)
        done = {job.pod for job in placed}
        for job in placed:
            assert job.departure is not None
            heapq.heappush(live, (now + job.departure - job.arrival, job.pod))
            waits.append(now - job.arrival)
            figures.wait_of[job.pod] = now - job.arrival
            if job.request.share >= LARGE_SHARE:
                large_waits.append(now - job.arrival)
            if now > job.arrival:
                figures.waited += 1
            if now <= horizon:
                figures.placed += 1
                figures.share_placed += job.request.share
        newcomers = pending[len(pending) - fresh :] if fresh else []
        for job in newcomers:
            if job.pod not in done and _free_share(model, job, per_model) >= job.request.share:
                figures.frag_failures += 1
        if done:
            pending = [job for job in pending if job.pod not in done]
        events += 1
        if now <= horizon and events % sample_every == 0 and now >= warm_from:
            u = gpu_utilization(model)
            util_all.append(u)
            if pending:
                util_saturated.append(u)
    figures.never = len(pending)
    figures.never_pods = tuple(job.pod for job in pending)
    figures.failures = figures.jobs - figures.placed
    figures.utilization = statistics.fmean(util_saturated or util_all or [0.0])
    figures.fragmentation = fragmentation(model)
    figures.seconds = sum(pass_times)
    figures.passes = len(pass_times)
    figures.decisions = service.decisions
    figures.wait_p50 = percentile(waits, 0.50)
    figures.wait_p99 = percentile(waits, 0.99)
    figures.wait_mean = statistics.fmean(waits) if waits else 0.0
    figures.large_wait_p99 = percentile(large_waits, 0.99)
    figures.large_wait_max = max(large_waits, default=0.0)
    figures.pass_p99_ms = percentile(pass_times, 0.99) * 1000
    notes = [
        f"{figures.passes} passes, {figures.decisions} decisions",
        f"{figures.waited} jobs waited",
        f"mean wait {figures.wait_mean:.0f}s; jobs of >= {LARGE_SHARE:g} GPUs: "
        f"wait p99 {figures.large_wait_p99:.0f}s, max {figures.large_wait_max:.0f}s",
        f"util while jobs waited from {len(util_saturated)} of {len(util_all)} samples",
    ]
    if figures.never:
        notes.append(f"{figures.never} never placed")
    if isinstance(service, Joint):
        notes.append(
            f"{service.orders} orders tried, {service.gained:.2f} GPU share placed beyond "
            "queue order"
        )
    if isinstance(scheduler, RealScheduler) and allocator_before is not None:
        runs, seconds = allocator_before
        s = scheduler.allocator.stats
        notes.append(
            f"{s.runs - runs} dra-allocate runs ({s.seconds - seconds:.1f}s), "
            f"{scheduler.disagreements} geometry disagreements"
        )
    figures.notes = "; ".join(notes)
    return figures


def _copy_stats(allocator: CachedAllocator) -> tuple[int, float]:
    return allocator.stats.runs, allocator.stats.seconds


def _free_share(model: ClusterModel, job: Job, per_model: dict[str, int]) -> float:
    return sum((1 - model.utilization(k)) * per_model.get(k, 0) for k in job.request.models)
