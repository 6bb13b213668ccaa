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

from controller.reconciler import Kind

Obj = dict[str, Any]

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


def slice_usage(slices: Iterable[Obj], claims: Iterable[Obj], driver: str) -> SliceUsage:
    """Memory-slice usage over every GPU (counter set) this driver publishes."""
    generation: dict[str, int] = {}
    pool_slices: list[Obj] = []
    for s in slices:
        spec = s.get("spec", {})
        if spec.get("driver") != driver:
            continue
        pool = spec.get("pool", {})
        generation[pool.get("name", "")] = max(
            generation.get(pool.get("name", ""), 0), int(pool.get("generation") or 0)
        )
        pool_slices.append(spec)
    sets: dict[tuple[str, str], set[int]] = {}
    consumes: dict[tuple[str, str], list[tuple[str, set[int]]]] = {}
    for spec in pool_slices:
        pool = spec.get("pool", {})
        name = pool.get("name", "")
        if int(pool.get("generation") or 0) != generation[name]:
            continue
        for cs in spec.get("sharedCounters") or []:
            sets[(name, cs.get("name", ""))] = _memory_slices(cs.get("counters"))
        for dev in spec.get("devices") or []:
            consumes[(name, dev.get("name", ""))] = [
                (str(cc.get("counterSet", "")), _memory_slices(cc.get("counters")))
                for cc in dev.get("consumesCounters") or []
            ]
    used: dict[tuple[str, str], set[int]] = {k: set() for k in sets}
    for claim in claims:
        alloc = claim.get("status", {}).get("allocation") or {}
        for r in alloc.get("devices", {}).get("results", []) or []:
            if r.get("driver") != driver:
                continue
            for counter_set, idx in consumes.get((r.get("pool", ""), r.get("device", "")), []):
                key = (r.get("pool", ""), counter_set)
                if key in used:
                    used[key] |= idx & sets[key]
    total = sum(len(v) for v in sets.values())
    n_used = sum(len(v) for v in used.values())
    runs = sum(_largest_run(sets[k] - used[k]) for k in sets)
    return SliceUsage(gpus=len(sets), total=total, used=n_used, free_largest_runs=runs)


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
            buckets=(
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
            ),
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

    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None:
        self.allocation_latency.observe(seconds)
        for p in profiles:
            self.allocations.labels(profile=p).inc()

    def observe_decision(self, seconds: float) -> None:
        self.decision_latency.observe(seconds)

    def set_queue_depth(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def count_outcome(self, outcome: str) -> None:
        self.outcomes.labels(outcome=outcome).inc()

    def update_usage(self, stores: Mapping[Kind, Mapping[str, Obj]], driver: str) -> SliceUsage:
        usage = slice_usage(stores[Kind.SLICE].values(), stores[Kind.CLAIM].values(), driver)
        self.utilization.set(usage.utilization)
        self.fragmentation.set(usage.fragmentation)
        self.gpus.set(usage.gpus)
        return usage
