"""Prometheus metrics of the controller and the pure computation of slice usage gauges.

Utilization and fragmentation are computed from what the API says (ResourceSlices and allocated
claims), not from the placement engine's private model, so an operator can trust them even when
the engine has a bug: they measure the cluster, not the controller's belief about it.

- utilization: memory slices (the `memory-slice-<i>` counters of every GPU's counter set) taken by
  allocated devices, over all memory slices;
- fragmentation: 1 - (sum over GPUs of the largest free contiguous run) / (all free slices).
  0 means every GPU's free space is one block; it grows as free space splinters into runs too
  small for big profiles.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.objects import Kind
from driver.apiviews import ClaimView, ObjectView, SliceView
from process.kube import Obj

_SLICE_COUNTER = re.compile(r"^memory-slice-(\d+)$")


@dataclass(frozen=True)
class SliceUsage:
    gpus: int
    total: int
    used: int
    free_largest_runs: int

    @property
    def utilization(self) -> float:
        return self.used / self.total if self.total else 0.0

    @property
    def fragmentation(self) -> float:
        free = self.total - self.used
        return 1.0 - self.free_largest_runs / free if free else 0.0


def _largest_run(free: Iterable[int]) -> int:
    best = run = 0
    prev: int | None = None
    for i in sorted(free):
        run = run + 1 if prev is not None and i == prev + 1 else 1
        best = max(best, run)
        prev = i
    return best


def _memory_slices(counters: Iterable[str] | None) -> set[int]:
    """Indices of the `memory-slice-<i>` names among a counter set's (or a device's) counters."""
    return {int(m.group(1)) for c in counters or () if (m := _SLICE_COUNTER.match(c)) is not None}


@dataclass(frozen=True)
class _SlicePart:
    """What one ResourceSlice says about memory slices: its counter sets' and its devices'."""

    pool: str
    generation: int
    sets: tuple[tuple[str, frozenset[int]], ...]
    consumes: Mapping[str, tuple[tuple[str, frozenset[int]], ...]]


def _slice_part(s: Obj, driver: str, shared: dict[Any, Any] | None = None) -> _SlicePart | None:
    """``shared`` (kept by the caller across slices) gives one object per distinct counter
    set and consumption: every GPU of a model consumes the same memory slices, and a fresh
    frozenset per device cost ~80 KB per GPU node."""
    view = SliceView(s)
    if view.driver != driver:
        return None
    one: dict[Any, Any] = {} if shared is None else shared

    def share(value: Any) -> Any:
        return one.setdefault(value, value)

    return _SlicePart(
        pool=view.pool_name,
        generation=view.pool_generation,
        sets=share(
            tuple(
                (cs.get("name", ""), frozenset(_memory_slices(cs.get("counters"))))
                for cs in view.spec.get("sharedCounters") or []
            )
        ),
        consumes={
            dev.get("name", ""): share(
                tuple(
                    (
                        str(cc.get("counterSet", "")),
                        share(frozenset(_memory_slices(cc.get("counters")))),
                    )
                    for cc in dev.get("consumesCounters") or []
                )
            )
            for dev in view.devices
        },
    )


def _usage(parts: Iterable[_SlicePart], claims: Iterable[Obj], driver: str) -> SliceUsage:
    by_pool: dict[str, list[_SlicePart]] = {}
    for part in parts:
        current = by_pool.get(part.pool)
        if current is None or part.generation > current[0].generation:
            by_pool[part.pool] = [part]
        elif part.generation == current[0].generation:
            current.append(part)
    sets: dict[tuple[str, str], frozenset[int]] = {
        (pool, name): idx for pool, ps in by_pool.items() for p in ps for name, idx in p.sets
    }
    used: dict[tuple[str, str], set[int]] = {k: set() for k in sets}
    for claim in claims:
        for r in ClaimView(claim).results:
            if r.get("driver") != driver:
                continue
            pool, device = r.get("pool", ""), r.get("device", "")
            for part in by_pool.get(pool, ()):
                for counter_set, idx in part.consumes.get(device, ()):
                    key = (pool, counter_set)
                    if key in used:
                        used[key] |= idx & sets[key]
    total = sum(len(v) for v in sets.values())
    n_used = sum(len(v) for v in used.values())
    runs = sum(_largest_run(sets[k] - used[k]) for k in sets)
    return SliceUsage(gpus=len(sets), total=total, used=n_used, free_largest_runs=runs)


def slice_usage(slices: Iterable[Obj], claims: Iterable[Obj], driver: str) -> SliceUsage:
    """Memory-slice usage over every GPU (counter set) this driver publishes."""
    parts = (p for s in slices if (p := _slice_part(s, driver)) is not None)
    return _usage(parts, claims, driver)


class SliceUsageIndex:
    """`slice_usage` over a store of slices that reads each slice once per resourceVersion:
    at 1,000 GPU nodes reading every device's counters took over a second per pass."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self._parts: dict[str, tuple[str, _SlicePart | None]] = {}
        self._shared: dict[Any, Any] = {}

    def usage(self, slices: Mapping[str, Obj], claims: Iterable[Obj]) -> SliceUsage:
        parts: dict[str, tuple[str, _SlicePart | None]] = {}
        for key, s in slices.items():
            rv = ObjectView(s).resource_version
            known = self._parts.get(key)
            if rv and known is not None and known[0] == rv:
                parts[key] = known
            else:
                parts[key] = (rv, _slice_part(s, self.driver, self._shared))
        self._parts = parts
        if len(self._shared) > 1 << 16:
            self._shared = {}  # parts of replaced slices; those kept hold their own
        return _usage((p for _, p in parts.values() if p is not None), claims, self.driver)


_DECISION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1,
    5,
)
"""Buckets of the decision histograms: fine around the 2 ms target, up to 5 s."""


class ControllerMetrics:
    """The controller's metrics on their own registry (served by `prometheus_client`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.allocation_latency = Histogram(
            "carve_allocation_latency_seconds",
            "Time from the controller first seeing a pod to all its claims being allocated.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
            registry=r,
        )
        # Only the placement engine's own work (Planner.plan): the allocation latency above also
        # holds queueing and API writes, and its buckets are too coarse for a millisecond target.
        self.decision_latency = Histogram(
            "carve_decision_seconds",
            "Time the placement engine took to decide one pod (placed or not).",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        # The same decisions in this thread's CPU time: where carve_decision_seconds is much
        # larger, the thread waited for a CPU or the GIL, not for the engine.
        self.decision_cpu = Histogram(
            "carve_decision_cpu_seconds",
            "CPU time the deciding thread spent on one pod's placement decision.",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "carve_pending_pods", "Pods waiting for the controller to place them.", registry=r
        )
        self.allocations = Counter(
            "carve_allocations", "Devices allocated, by MIG profile.", ["profile"], registry=r
        )
        self.outcomes = Counter(
            "carve_placement_outcomes",
            "Placement attempts by outcome: allocated, unplaceable, write-failed, native-fallback.",
            ["outcome"],
            registry=r,
        )
        self.utilization = Gauge(
            "carve_slice_utilization_ratio",
            "Memory slices taken by allocated devices over all published memory slices.",
            registry=r,
        )
        self.fragmentation = Gauge(
            "carve_slice_fragmentation_ratio",
            "1 - sum of each GPU's largest free contiguous run over all free memory slices.",
            registry=r,
        )
        self.gpus = Gauge("carve_gpus", "GPUs (counter sets) published by the driver.", registry=r)
        self.leader = Gauge("carve_leader", "1 while this replica holds the lease.", registry=r)
        self.conflicts = Gauge(
            "carve_allocation_conflicts",
            "GPUs whose allocated claims contradict each other (one device allocated twice, "
            "overlapping slices); carve places nothing on them until it is resolved.",
            registry=r,
        )
        self.duplicate_gpus = Gauge(
            "carve_duplicate_gpus",
            "GPU UUIDs published by two nodes; carve counts each on the node that published it "
            "first (controller.duplicategpus).",
            registry=r,
        )
        self.contract_skew = Gauge(
            "carve_contract_skew_nodes",
            "Nodes whose kubelet plugin speaks a carve contract version more than one away from "
            "this controller's; carve places nothing on them (controller.skew).",
            registry=r,
        )
        self.shed_pods, self.pods_shed = _shed_metrics(r)
        # Every request the process sends (process.kube.requestcount): what a placement and a
        # release cost the apiserver, by verb and resource, and how many answered an error.
        self.api_requests = Counter(
            "carve_api_requests",
            "API requests sent, by verb, resource and outcome (HTTP status code or no-answer).",
            ["verb", "resource", "outcome"],
            registry=r,
        )
        self._usage_index: SliceUsageIndex | None = None

    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None:
        self.allocation_latency.observe(seconds)
        for p in profiles:
            self.allocations.labels(profile=p).inc()

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None:
        self.decision_latency.observe(seconds)
        self.decision_cpu.observe(cpu_seconds)

    def set_queue_depth(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def count_request(self, verb: str, resource: str, outcome: str) -> None:
        self.api_requests.labels(verb, resource, outcome).inc()

    def count_outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome=outcome).inc()

    def set_conflicts(self, gpus: int) -> None:
        self.conflicts.set(gpus)

    def set_duplicate_gpus(self, gpus: int) -> None:
        self.duplicate_gpus.set(gpus)

    def set_contract_skew(self, nodes: int) -> None:
        self.contract_skew.set(nodes)

    def update_usage(self, stores: Mapping[Kind, Mapping[str, Obj]], driver: str) -> SliceUsage:
        if self._usage_index is None or self._usage_index.driver != driver:
            self._usage_index = SliceUsageIndex(driver)
        usage = self._usage_index.usage(stores[Kind.SLICE], stores[Kind.CLAIM].values())
        self.utilization.set(usage.utilization)
        self.fragmentation.set(usage.fragmentation)
        self.gpus.set(usage.gpus)
        return usage


def _shed_metrics(r: CollectorRegistry) -> tuple[Gauge, Counter]:
    """What the namespace share (controller.namespaceshare) sheds: now, and since the start."""
    return (
        Gauge(
            "carve_shed_pods",
            "Waiting pods not kept in memory now because their namespace has --namespace-pod-"
            "share pods waiting already (controller.namespaceshare); each is taken up in turn.",
            registry=r,
        ),
        Counter(
            "carve_pods_shed",
            "Pods shed since the process started (a pod shed again after a restart counts again).",
            registry=r,
        ),
    )
