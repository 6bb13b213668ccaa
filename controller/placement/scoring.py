"""The packing policy: how the engine prefers one feasible placement over another.

**To change how carve packs, change this file.** Everything the engine prefers is decided here;
the search (:mod:`.search`) only asks a :class:`PackingPolicy` three questions and follows the
answers:

1. :meth:`~PackingPolicy.placement_key`: in which order to try the feasible placements on one
   GPU state (the multi-device search tries them in this order);
2. :meth:`~PackingPolicy.offers` (with :meth:`~PackingPolicy.bucket_rank`): in which order a
   single-device decision walks the cluster's GPUs;
3. :meth:`~PackingPolicy.solution_rank`: which node's solution wins a multi-device decision.

Best fit (:class:`BestFit`, the default). A GPU's *value* is what it still admits, weighted
towards large profiles: ``sum(admits[p] * size(p)**2)``. The *loss* of a candidate is value
before minus value after, and the engine takes the smallest. Placing a small slice on a GPU
that is already split costs little, on an empty GPU it destroys the room for a 7g, so loss alone
packs GPUs; ties prefer GPUs and nodes already in use. Before the loss comes the GPU model's
utilisation band, so that a request several models can serve goes to the model with the most
room (see docs/placement.md and ``python -m bench.packing``).

Least waste (:class:`LeastWaste`) is best fit behind one more preference, measured on the
public Alibaba GPU trace (``python -m bench.trace``, docs/benchmarks.md). A candidate's *waste*
is the share of its GPU that the placement uses plus the share it leaves that no further copy
of the same request could use (``size + free_after - size * admits_after[profile]``, over the
GPU's memory units): a 4g on an empty 8-slice GPU wastes the whole GPU (a second 4g never fits
beside it), a 2g on an empty 4-slice A30 only half. Candidates that waste more than one memory
slice of an 8-slice GPU beyond the least wasteful candidate of the decision come last; among
the rest best fit decides (band, loss, ...), so the band still keeps a scarce model for the
requests only it can serve. Pods of one workload share a request shape, which is why the waste
is measured against copies of the request itself. It changes single-device decisions only
(multi-device solutions rank as in best fit).

Fill holes (:class:`FillHoles`) is least waste with the last two keys swapped: among the
candidates within the waste tolerance, the smallest loss comes before the model's utilisation
band. Best fit's band sends a request several models can serve to the least used model even
when that splits an empty GPU there while a busier model has a hole that fits; with pods that
come and go, those split GPUs are what a 7g or a multi-GPU pod then waits for. Measured end to
end against kube-scheduler with ``python -m bench.cluster_packing`` (docs/benchmarks.md), where
it is the controller's default. Multi-device solutions rank as in best fit.

First fit (:class:`FirstFit`) is a naive reference kept for the benchmark and for comparison:
first GPU in (node, uuid) order, first placement in NVML order. It is not kube-scheduler's
behaviour (which scores nodes first); the benchmarks run the real kube-scheduler for that.
:class:`Policy` is the public way to choose one (the controller's ``--packing-policy``);
:func:`packing_policy` maps it to its implementation.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping
from enum import StrEnum
from fractions import Fraction
from typing import Protocol

from controller.model import WHOLE_GPU, ClusterModel, GpuRecord, Occupancy
from controller.placement.cache import BoundedCache
from controller.placement.feasibility import occupancy_after
from controller.placement.records import BucketOption, Candidate, DeviceSet, GpuOffer
from driver.geometry import Geometry, GpuState

PRESSURE_BANDS = 20
"""Utilisation bands (5% steps) of a GPU model; within a band, the loss decides."""


class Policy(StrEnum):
    BEST_FIT = "best-fit"
    LEAST_WASTE = "least-waste"
    """Best fit after avoiding placements that strand part of their GPU for the request's
    own shape; see the module docstring."""
    FILL_HOLES = "fill-holes"
    """Least waste, then the smallest loss before the model's utilisation band: a slice goes
    into a hole of a split GPU before it splits an empty one; see the module docstring."""
    FIRST_FIT = "first-fit"
    """A naive reference: first GPU (node, then GPU order), first free placement in NVML
    order. Kept for the packing benchmark and for comparison, not for production. It is not
    what kube-scheduler does (kube-scheduler scores nodes, then its allocator takes the first
    fitting device in published order): the benchmarks run the real one for that."""


DEFAULT_POLICY = Policy.LEAST_WASTE
"""The policy the engine, the controller's planner and ``--packing-policy`` default to: of
carve's policies, the one that held the most GPU share over both workload families of
``python -m bench.cluster_packing`` at 100 nodes (in process, where policies can be told
apart by tenths of a point; the end-to-end run sets carve against kube-scheduler;
docs/benchmarks.md)."""


class GpuValues:
    """A GPU state's value, ``sum(admits[p] * size(p)**2)``; 0 for a blocked GPU.

    Cached per (model, state): GPU states have few distinct values per model, and the geometry's
    ``admits`` is the expensive part. Both policies report losses with it (``Placement.loss``),
    only best fit ranks by it.
    """

    def __init__(self) -> None:
        self._values: BoundedCache[tuple[Geometry, GpuState], int] = BoundedCache()
        self._weights: BoundedCache[Geometry, Mapping[int, int]] = BoundedCache()

    def value(self, geometry: Geometry, occupancy: Occupancy) -> int:
        if occupancy.blocked:
            return 0
        key = (geometry, occupancy.state)
        value = self._values.get(key)
        if value is None:
            weights = self._weights.get(geometry)
            if weights is None:
                weights = self._weights.put(
                    geometry, {p.id: p.size * p.size for p in geometry.model.profiles}
                )
            admits = geometry.admits(occupancy.state)
            value = self._values.put(key, sum(weights.get(pid, 0) * n for pid, n in admits.items()))
        return value


class PackingPolicy(Protocol):
    """The three preferences the search asks for; see the module docstring."""

    def placement_key(
        self, geometry: Geometry, profile_id: int, start: int, loss: int
    ) -> tuple[object, ...]:
        """Sort key of one feasible placement on a GPU (smallest first)."""
        ...

    def bucket_rank(
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, best: Candidate
    ) -> tuple[object, ...]:
        """Rank of a (kind, occupancy, node busy) bucket whose best placement is ``best``."""
        ...

    def offers(self, options: list[BucketOption]) -> Iterator[GpuOffer]:
        """The GPUs a single-device decision tries, in order, until one sits on a node that
        passes node fit. May reorder ``options`` in place."""
        ...

    def solution_rank(
        self, node: str, busy: bool, loss: int, models: Iterable[str]
    ) -> tuple[object, ...]:
        """Rank of a node's multi-device solution (``models``: the GPU models it uses)."""
        ...


class BestFit:
    """Smallest loss first, after the GPU model's utilisation band; see the module docstring."""

    def __init__(self, model: ClusterModel) -> None:
        self._model = model

    def placement_key(
        self, geometry: Geometry, profile_id: int, start: int, loss: int
    ) -> tuple[object, ...]:
        return (loss, profile_id, start)

    def bucket_rank(
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, best: Candidate
    ) -> tuple[object, ...]:
        """First the GPU model's utilisation band (5% steps): a request that several models can
        serve goes to the one with the most room left, so the scarce model keeps its capacity
        for the requests only it can serve (on the packing benchmark this is worth more than
        any choice inside a model). Then the smallest loss, then GPUs and nodes in use, then a
        fixed order of model and state so that equal situations decide identically."""
        model_key = gpu.inventory.model.key
        return (
            self._band(model_key),
            best.loss,
            not occupancy.in_use,
            not busy,
            model_key,
            occupancy.state.instances,
            best.profile_id,
            best.start,
        )

    def offers(self, options: list[BucketOption]) -> Iterator[GpuOffer]:
        """Buckets best rank first; inside a bucket, its GPUs in (node, uuid) order."""
        heapq.heapify(options)
        while options:
            option = heapq.heappop(options)
            for node, uuid in option.members:
                yield GpuOffer(node, uuid, option.profile_id, option.start, option.loss)

    def solution_rank(
        self, node: str, busy: bool, loss: int, models: Iterable[str]
    ) -> tuple[object, ...]:
        """The most utilised model among the chosen GPUs, then the total loss, then busy
        nodes, then the node name (so that equal solutions decide identically)."""
        return (max(self._band(m) for m in models), loss, not busy, node)

    def _band(self, model_key: str) -> int:
        return int(self._model.utilization(model_key) * PRESSURE_BANDS)


class FirstFit:
    """The first GPU in (node, uuid) order, the first placement in NVML order."""

    def __init__(self) -> None:
        self._orders: BoundedCache[Geometry, Mapping[tuple[int, int], int]] = BoundedCache()

    def placement_key(
        self, geometry: Geometry, profile_id: int, start: int, loss: int
    ) -> tuple[object, ...]:
        return (self._nvml_order(geometry).get((profile_id, start), -1), profile_id, start)

    def bucket_rank(
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, best: Candidate
    ) -> tuple[object, ...]:
        return ()  # unused: offers() walks GPUs by (node, uuid), not buckets by rank

    def offers(self, options: list[BucketOption]) -> Iterator[GpuOffer]:
        """Every bucket's GPUs merged into one (node, uuid) order."""
        streams = [_offers_of(o) for o in options]
        return heapq.merge(*streams)

    def solution_rank(
        self, node: str, busy: bool, loss: int, models: Iterable[str]
    ) -> tuple[object, ...]:
        return (node,)

    def _nvml_order(self, geometry: Geometry) -> Mapping[tuple[int, int], int]:
        """(profile id, start) -> position in the model's profile list and NVML placement
        order: the order a first-fit allocator walks published devices in."""
        order = self._orders.get(geometry)
        if order is None:
            pairs = ((p.id, pl.start) for p in geometry.model.profiles for pl in p.placements)
            order = self._orders.put(geometry, {pair: i for i, pair in enumerate(pairs)})
        return order


WASTE_TOLERANCE = Fraction(1, 8)
"""Waste (in GPUs) a candidate may exceed the decision's least wasteful candidate by and still
be ranked by best fit: one memory slice of an 8-slice GPU."""


class LeastWaste(BestFit):
    """Best fit among the candidates within :data:`WASTE_TOLERANCE` of the least waste."""

    def __init__(self, model: ClusterModel) -> None:
        super().__init__(model)
        self._waste: BoundedCache[tuple[Geometry, Occupancy, int], Fraction] = BoundedCache()

    def bucket_rank(
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, best: Candidate
    ) -> tuple[object, ...]:
        """(waste, then best fit's rank); :meth:`offers` turns the waste into within or
        beyond the tolerance once every bucket's waste is known."""
        waste = self.waste(gpu.geometry, best.after, best.profile_id)
        return (waste, *super().bucket_rank(gpu, occupancy, busy, best))

    def offers(self, options: list[BucketOption]) -> Iterator[GpuOffer]:
        if options:
            wastes = [_waste_of(o) for o in options]
            limit = min(wastes) + WASTE_TOLERANCE
            options = [
                o._replace(rank=(w > limit, *o.rank[1:]))
                for o, w in zip(options, wastes, strict=True)
            ]
        return super().offers(options)

    def waste(self, geometry: Geometry, after: Occupancy, profile_id: int) -> Fraction:
        """Share of the GPU the placement uses plus what no further copy of it can use."""
        key = (geometry, after, profile_id)
        hit = self._waste.get(key)
        if hit is not None:
            return hit
        units = geometry.model.memory_units
        if after.blocked or profile_id == WHOLE_GPU:
            value = Fraction(1)
        else:
            size = geometry.model.profile_by_id(profile_id).size
            free = units - after.state.occupied.bit_count()
            again = geometry.admits(after.state).get(profile_id, 0)
            value = Fraction(size + free - size * again, units)
        return self._waste.put(key, value)


class FillHoles(LeastWaste):
    """Least waste, then loss before band (see the module docstring)."""

    def bucket_rank(
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, best: Candidate
    ) -> tuple[object, ...]:
        """(waste, loss, band, then best fit's other keys): best fit's rank with its first
        two keys, the band and the loss, swapped."""
        waste, band, loss, *rest = super().bucket_rank(gpu, occupancy, busy, best)
        return (waste, loss, band, *rest)


def _waste_of(option: BucketOption) -> Fraction:
    waste = option.rank[0]
    assert isinstance(waste, Fraction)
    return waste


def _offers_of(option: BucketOption) -> Iterator[GpuOffer]:
    for node, uuid in option.members:
        yield GpuOffer(node, uuid, option.profile_id, option.start, option.loss)


def packing_policy(policy: Policy, model: ClusterModel) -> PackingPolicy:
    """The implementation behind a :class:`Policy` value."""
    if policy is Policy.FIRST_FIT:
        return FirstFit()
    if policy is Policy.LEAST_WASTE:
        return LeastWaste(model)
    if policy is Policy.FILL_HOLES:
        return FillHoles(model)
    return BestFit(model)


class CandidateTable:
    """Feasible placements on one GPU state, best first in the policy's order, with losses.

    Cached per (model, occupancy, eligible set): the answer depends on nothing else, and the
    same few states recur across thousands of GPUs and decisions.
    """

    def __init__(self, policy: PackingPolicy, values: GpuValues) -> None:
        self._policy = policy
        self._values = values
        self._cache: BoundedCache[tuple[Geometry, Occupancy, DeviceSet], list[Candidate]] = (
            BoundedCache()
        )

    def candidates(
        self, gpu: GpuRecord, occupancy: Occupancy, eligible: DeviceSet
    ) -> list[Candidate]:
        geometry = gpu.geometry
        key = (geometry, occupancy, eligible)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        before = self._values.value(geometry, occupancy)
        out = []
        for pid, start in eligible:
            after = occupancy_after(geometry, occupancy, pid, start)
            if after is None:
                continue
            loss = before - self._values.value(geometry, after)
            out.append(
                Candidate(
                    self._policy.placement_key(geometry, pid, start, loss), loss, pid, start, after
                )
            )
        out.sort(key=lambda c: c.key)
        return self._cache.put(key, out)
