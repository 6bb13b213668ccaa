"""The same workload as ``python -m bench.cluster_packing`` in process: carve's engine on a
model of the fleet, with the queue model of ``tests.bench.queued`` (served in arrival order,
every departure retries the queue, a job runs its lifetime from its start).

No control plane, no latencies, no machine load: each decision is the engine's alone, so one
run takes seconds and is repeatable to the bit. That makes it the instrument for comparing
carve's policies with each other (``--in-process``), which the end-to-end run on a shared
machine cannot resolve to a point or two; kube-scheduler's side has no such model here (its
node scoring is what the end-to-end run measures).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controller.model import ClusterModel
from controller.nodefit import PodNeeds, Resources
from controller.placement import NoPlacement, Policy
from driver.allocation import AllocatedDevice
from tests.bench.alibaba import claim_spec
from tests.bench.cluster_figures import JobRecord, fleet_model
from tests.bench.cluster_workload import Workload
from tests.bench.queued import InOrder, QueueService, replay_queued
from tests.bench.replay import CarveScheduler, Job

_MIB = 2**20


class _Recording(CarveScheduler):
    """carve's engine, noting where each job's devices went."""

    def __init__(self, model: ClusterModel, policy: Policy) -> None:
        super().__init__(model, policy)
        self.placed: dict[str, tuple[str, tuple[AllocatedDevice, ...]]] = {}

    def place(self, model: ClusterModel, job: Job) -> bool:
        result = self.engine.place(self.request(job))
        if isinstance(result, NoPlacement):
            return False
        self.engine.commit(result, job.pod, job.needs)
        self.placed[job.pod] = (result.node, tuple(d for h in result.holds() for d in h.devices))
        return True


def jobs_of(workload: Workload) -> list[Job]:
    """The workload as the queued replay's jobs (departure - arrival is the lifetime)."""
    return [
        Job(
            j.name,
            None,
            j.request,
            claim_spec(j.request),
            PodNeeds(Resources(j.cpu_milli, j.memory_mib * _MIB, 1)),
            j.arrival,
            j.arrival + j.lifetime,
        )
        for j in workload.jobs
    ]


def replay(workload: Workload, policy: Policy, end: float) -> dict[str, JobRecord]:
    """One carve policy over the workload; records as an arm of the end-to-end run keeps
    them, cut at ``end`` (what starts later counts as never bound)."""
    recorder: list[_Recording] = []

    def make(model: ClusterModel, _upcoming: Callable[[], Sequence[Job]]) -> QueueService:
        recorder.append(_Recording(model, policy))
        return InOrder(recorder[0])

    figures = replay_queued(fleet_model(workload.nodes), jobs_of(workload), make)
    placed = recorder[0].placed
    out = {}
    for j in workload.jobs:
        wait = figures.wait_of.get(j.name)
        if wait is None or j.arrival + wait > end:
            out[j.name] = JobRecord(j.name, j.arrival)
            continue
        start = j.arrival + wait
        node, devices = placed[j.name]
        ended = start + j.lifetime
        out[j.name] = JobRecord(
            j.name, j.arrival, start, node, devices, ended if ended <= end else None
        )
    return out
