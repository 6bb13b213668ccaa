"""The placement engine: node, GPU and MIG placement for every carve claim of a pod at once.

Pure: it reads a :class:`~controller.model.ClusterModel` and answers with a :class:`Placement`
(one device per request slot, all on one node) or a :class:`NoPlacement` that says why, in words
fit for an event. It never changes the model; the caller commits a placement (``commit``) once
it has decided to write it, so a failed write leaves nothing behind.

Best fit. A GPU's *value* is what it still admits, weighted towards large profiles:
``sum(admits[p] * size(p)**2)``. The *loss* of a candidate is value before minus value after;
the engine takes the candidate with the smallest loss. Placing a small slice on a GPU that is
already split costs little, on an empty GPU it destroys the room for a 7g, so loss alone packs
GPUs; ties prefer GPUs and nodes already in use. Values are cached per (model, state) and the
model indexes GPUs by (kind, occupancy, node busy), so a single-device decision looks at the
distinct states in the cluster, not at every GPU.

Several devices (several requests or claims, ``count`` > 1, ``allocationMode: All``,
constraints) are solved per node by a bounded depth-first search; nodes whose GPUs are in the
same states are solved once. ``firstAvailable`` alternatives are tried in order of preference:
the first combination that fits anywhere wins, as in kube-scheduler.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from controller.claims import (
    AllocatedDevice,
    AllocationMode,
    Alternative,
    ClaimHold,
    ClaimKey,
    ClaimSpec,
    ConstraintKind,
    DeviceClass,
    DeviceConstraint,
    ExactRequest,
)
from controller.model import (
    WHOLE_GPU,
    ClusterModel,
    GpuInventory,
    GpuRecord,
    Occupancy,
    PublishedDevice,
)
from controller.nodefit import MisfitReason, NodeMisfit, PodNeeds, check_node
from driver.cel import AttributeValue, CelError, SelectorEvaluator
from driver.contract import IDENTITY_ATTRIBUTES
from driver.geometry import EMPTY_STATE, Geometry, GpuState
from driver.naming import DEFAULT_DRIVER_NAME

# ---------------------------------------------------------------------------------------------
# Public values


class Policy(StrEnum):
    BEST_FIT = "best-fit"
    FIRST_FIT = "first-fit"
    """The peers' baseline: first GPU (node, then GPU order), first free placement in NVML
    order. Kept for the packing benchmark and for comparison, not for production."""


@dataclass(frozen=True)
class ClaimToPlace:
    key: ClaimKey
    spec: ClaimSpec


@dataclass(frozen=True)
class PlacementRequest:
    """One pod's unallocated carve claims.

    ``node`` pins the pod to a node (some of its claims are already allocated there, or it is
    already bound); None lets the engine choose.
    """

    pod: str
    needs: PodNeeds
    claims: tuple[ClaimToPlace, ...]
    node: str | None = None


@dataclass(frozen=True)
class DeviceChoice:
    """One allocated device: what ``status.allocation.devices.results[]`` needs, plus the MIG
    facts the events and metrics show."""

    claim: ClaimKey
    request: str  # "<request>" or "<request>/<subrequest>"
    driver: str
    pool: str
    device: str
    node: str
    gpu_uuid: str
    profile_id: int  # WHOLE_GPU for a whole GPU
    start: int
    profile: str  # e.g. "3g.40gb", "gpu" for a whole GPU


@dataclass(frozen=True)
class Placement:
    node: str
    choices: tuple[DeviceChoice, ...]
    loss: int
    """Sum of the chosen candidates' losses (lower is a tighter fit); for logs and tests."""

    def holds(self) -> tuple[ClaimHold, ...]:
        """What the model must record once the claims are written."""
        by_claim: dict[ClaimKey, list[AllocatedDevice]] = {}
        for c in self.choices:
            by_claim.setdefault(c.claim, []).append(
                AllocatedDevice(c.request, c.driver, c.pool, c.device)
            )
        return tuple(ClaimHold(k, self.node, tuple(sorted(v))) for k, v in sorted(by_claim.items()))


class NoPlacementReason(StrEnum):
    UNKNOWN_DEVICE_CLASS = "UnknownDeviceClass"
    SELECTOR_ERROR = "SelectorError"
    NO_MATCHING_DEVICE = "NoMatchingDevice"
    INSUFFICIENT_DEVICES = "InsufficientDevices"
    NODE_MISFIT = "NodeMisfit"
    NO_NODE = "NoNode"


@dataclass(frozen=True)
class NoPlacement:
    """Why the pod cannot be placed now. ``permanent`` means retrying on capacity changes is
    pointless (the claim or class must change first)."""

    reason: NoPlacementReason
    message: str
    permanent: bool = False


# ---------------------------------------------------------------------------------------------
# Internal values


@dataclass(frozen=True)
class _Slot:
    """One device to find: a request slot of a claim (or all matching devices for ``All``)."""

    claim_index: int
    claim: ClaimKey
    request: str  # base request name
    alternative: Alternative

    @property
    def all_mode(self) -> bool:
        return self.alternative.spec.mode is AllocationMode.ALL


@dataclass(frozen=True)
class _Constraint:
    claim_index: int
    constraint: DeviceConstraint

    def covers(self, slot: _Slot) -> bool:
        listed = self.constraint.requests
        return slot.claim_index == self.claim_index and (
            not listed or slot.request in listed or slot.alternative.result_name in listed
        )


_Pick = tuple[int, int, int]  # (GPU position on the node, profile id, start)


@dataclass
class _Search:
    """Mutable state of one node's depth-first search."""

    gpus: list[GpuRecord]
    slots: list[_Slot]
    constraints: list[_Constraint]
    eligible: list[list[frozenset[tuple[int, int]]]]  # per slot, per GPU
    occupancy: list[Occupancy]
    picks: list[list[_Pick]]  # per slot; several for an All slot
    budget: int


_CACHE_LIMIT = 200_000
_EXHAUSTED = "search budget exhausted"

MAX_COMBINATIONS = 64
"""firstAvailable combinations tried per decision (8 alternatives on 32 requests would be
8**32); the first ones are the preferred ones."""
MAX_DEVICES_PER_POD = 128
"""Bounds the search depth; no node publishes anywhere near this many usable slices."""
MAX_RESULTS_PER_CLAIM = 32
"""status.allocation.devices.results limit."""
_PRESSURE_BANDS = 20


class _BudgetExhaustedError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# The engine


class PlacementEngine:
    """Chooses placements; see the module docstring. Not thread-safe (one decision at a time)."""

    def __init__(
        self,
        model: ClusterModel,
        classes: Mapping[str, DeviceClass],
        driver: str = DEFAULT_DRIVER_NAME,
        *,
        policy: Policy = Policy.BEST_FIT,
        evaluator: SelectorEvaluator | None = None,
        search_budget: int = 20_000,
    ) -> None:
        self.model = model
        self.classes: Mapping[str, DeviceClass] = classes
        self.driver = driver
        self.policy = policy
        self.evaluator = evaluator or SelectorEvaluator()
        self.search_budget = search_budget
        self._values: dict[tuple[Geometry, GpuState], int] = {}
        self._weights: dict[Geometry, dict[int, int]] = {}
        self._kind_eligible: dict[
            tuple[ExactRequest, tuple[str, ...], int], frozenset[tuple[int, int]]
        ] = {}
        self._reads_identity: dict[tuple[ExactRequest, tuple[str, ...]], bool] = {}
        self._candidate_cache: dict[
            tuple[Geometry, Occupancy, frozenset[tuple[int, int]]],
            list[tuple[tuple[object, ...], int, int, int, Occupancy]],
        ] = {}
        self._orders: dict[Geometry, Mapping[tuple[int, int], int]] = {}
        self._solutions: dict[
            tuple[tuple[object, ...], tuple[object, ...]],
            tuple[list[list[_Pick]], int] | str | None,
        ] = {}
        self._patterns: dict[
            tuple[str, str], tuple[GpuInventory, tuple[int, ...], tuple[object, ...]]
        ] = {}
        self._room_cache: dict[
            tuple[Geometry, Occupancy, frozenset[tuple[int, int]]],
            tuple[tuple[int, bool, str | None], ...],
        ] = {}

    # ------------------------------------------------------------------------------------------
    # Entry points

    def place(self, request: PlacementRequest) -> Placement | NoPlacement:
        """The best placement for all of the pod's claims, or why there is none."""
        problem = self._check_request(request)
        if problem is not None:
            return problem
        per_request = [
            (ci, claim, r) for ci, claim in enumerate(request.claims) for r in claim.spec.requests
        ]
        if not per_request:
            return NoPlacement(
                NoPlacementReason.NO_MATCHING_DEVICE,
                "the pod has no device requests to place",
                permanent=True,
            )
        constraints = [
            _Constraint(ci, c)
            for ci, claim in enumerate(request.claims)
            for c in claim.spec.constraints
        ]
        failures: list[NoPlacement] = []
        # firstAvailable: combinations in order of preference (lexicographic), first fit wins.
        combos = itertools.product(*(r.alternatives for _, _, r in per_request))
        for combo in itertools.islice(combos, MAX_COMBINATIONS):
            slots: list[_Slot] = []
            for (ci, claim, r), alt in zip(per_request, combo, strict=True):
                n = 1 if alt.spec.mode is AllocationMode.ALL else alt.spec.count
                slots.extend(_Slot(ci, claim.key, r.name, alt) for _ in range(n))
            result = self._place_slots(request, slots, constraints)
            if isinstance(result, Placement):
                too_many = self._over_result_limit(result)
                if too_many is None:
                    return result
                result = too_many
            if result is None or len(slots) > MAX_DEVICES_PER_POD:
                result = NoPlacement(
                    NoPlacementReason.INSUFFICIENT_DEVICES,
                    f"the pod asks for {len(slots)} devices; the controller places at most "
                    f"{MAX_DEVICES_PER_POD} per pod",
                )
            if result.permanent:
                return result
            failures.append(result)
        if len(failures) == 1:
            return failures[0]
        messages = list(dict.fromkeys(f.message for f in failures))
        return NoPlacement(failures[0].reason, "no alternative fits: " + " | ".join(messages[:8]))

    def commit(self, placement: Placement, pod: str, needs: PodNeeds) -> None:
        """Record a written placement in the model: its holds and the pod's requests."""
        for hold in placement.holds():
            self.model.hold(hold)
        self.model.set_pod(pod, placement.node, needs.requests)

    # ------------------------------------------------------------------------------------------
    # Validation and eligibility

    def _check_request(self, request: PlacementRequest) -> NoPlacement | None:
        missing = sorted(
            {
                name
                for c in request.claims
                for name in c.spec.device_classes()
                if name not in self.classes
            }
        )
        if missing:
            return NoPlacement(
                NoPlacementReason.UNKNOWN_DEVICE_CLASS,
                f"DeviceClass {', '.join(missing)} does not exist",
                permanent=True,
            )
        for c in request.claims:
            for r in c.spec.requests:
                for a in r.alternatives:
                    for expression in self._selectors(a.spec):
                        compiled = self.evaluator.compile(expression)
                        if isinstance(compiled, CelError):
                            return self._cel_failure(c.key, a, compiled)
        return None

    def _cel_failure(self, claim: ClaimKey, alt: Alternative, error: CelError) -> NoPlacement:
        return NoPlacement(
            NoPlacementReason.SELECTOR_ERROR,
            f"claim {claim} request {alt.result_name}: {error.message}",
            permanent=True,
        )

    def _selectors(self, spec: ExactRequest) -> tuple[str, ...]:
        return self.classes[spec.device_class].selectors + spec.selectors

    def _device_matches(self, spec: ExactRequest, device: PublishedDevice) -> bool | CelError:
        facts = device.facts
        if facts.driver != self.driver:
            return False
        for name, minimum in spec.capacity:
            have = next((v for k, v in facts.capacity if k == name), None)
            if have is None or have < minimum:
                return False
        return self.evaluator.matches_all(self._selectors(spec), facts)

    def _identity_dependent(self, spec: ExactRequest) -> bool:
        """Whether a selector may read per-GPU identity (then eligibility is per GPU)."""
        key = (spec, self._selectors(spec))
        hit = self._reads_identity.get(key)
        if hit is None:
            hit = False
            for expression in self._selectors(spec):
                compiled = self.evaluator.compile(expression)
                if (
                    isinstance(compiled, CelError)
                    or compiled.referenced is None
                    or compiled.referenced & IDENTITY_ATTRIBUTES
                ):
                    hit = True
            if len(self._reads_identity) >= _CACHE_LIMIT:
                self._reads_identity.clear()
            self._reads_identity[key] = hit
        return hit

    def _eligible(
        self, spec: ExactRequest, gpu: GpuRecord
    ) -> frozenset[tuple[int, int]] | CelError:
        """(profile id, start) of the GPU's devices the (sub)request may use."""
        if not self._identity_dependent(spec):
            # The class's selectors are part of the key: classes change in place.
            key = (spec, self._selectors(spec), gpu.kind)
            hit = self._kind_eligible.get(key)
            if hit is not None:
                return hit
            # Selectors that read no identity attribute see the same facts on every GPU of
            # the kind, so this GPU's answer is the kind's.
            result = self._eligible_on(spec, gpu)
            if not isinstance(result, CelError):
                if len(self._kind_eligible) >= _CACHE_LIMIT:
                    self._kind_eligible.clear()
                self._kind_eligible[key] = result
            return result
        return self._eligible_on(spec, gpu)

    def _eligible_on(
        self, spec: ExactRequest, gpu: GpuRecord
    ) -> frozenset[tuple[int, int]] | CelError:
        out = []
        for d in gpu.inventory.devices:
            verdict = self._device_matches(spec, d)
            if isinstance(verdict, CelError):
                return verdict
            if verdict:
                out.append((d.profile_id, d.start))
        return frozenset(out)

    # ------------------------------------------------------------------------------------------
    # Scoring

    def _value(self, geometry: Geometry, occupancy: Occupancy) -> int:
        if occupancy.blocked:
            return 0
        key = (geometry, occupancy.state)
        value = self._values.get(key)
        if value is None:
            weights = self._weights.get(geometry)
            if weights is None:
                weights = {p.id: p.size * p.size for p in geometry.model.profiles}
                self._weights[geometry] = weights
            admits = geometry.admits(occupancy.state)
            value = sum(weights.get(pid, 0) * n for pid, n in admits.items())
            self._values[key] = value
        return value

    @staticmethod
    def _after(geometry: Geometry, occupancy: Occupancy, pid: int, start: int) -> Occupancy | None:
        if occupancy.blocked:
            return None
        if pid == WHOLE_GPU:
            return Occupancy(EMPTY_STATE, blocked=True) if not occupancy.state.instances else None
        if not geometry.fits(occupancy.state, pid, start):
            return None
        return Occupancy(geometry.place(occupancy.state, pid, start))

    def _candidates(
        self, gpu: GpuRecord, occupancy: Occupancy, eligible: frozenset[tuple[int, int]]
    ) -> list[tuple[tuple[object, ...], int, int, int, Occupancy]]:
        """Feasible (sort key, loss, pid, start, next occupancy) on one GPU, best first.

        Cached per (model, occupancy, eligible set): the answer depends on nothing else, and
        the same few states recur across thousands of GPUs and decisions."""
        cache_key = (gpu.geometry, occupancy, eligible)
        hit = self._candidate_cache.get(cache_key)
        if hit is not None:
            return hit
        geometry = gpu.geometry
        before = self._value(geometry, occupancy)
        out = []
        order = self._nvml_order(geometry)
        for pid, start in eligible:
            nxt = self._after(geometry, occupancy, pid, start)
            if nxt is None:
                continue
            loss = before - self._value(geometry, nxt)
            if self.policy is Policy.FIRST_FIT:
                key: tuple[object, ...] = (order.get((pid, start), -1), pid, start)
            else:
                key = (loss, pid, start)
            out.append((key, loss, pid, start, nxt))
        out.sort(key=lambda c: c[0])
        if len(self._candidate_cache) >= _CACHE_LIMIT:
            self._candidate_cache.clear()
        self._candidate_cache[cache_key] = out
        return out

    def _nvml_order(self, geometry: Geometry) -> Mapping[tuple[int, int], int]:
        """(profile id, start) -> position in the model's profile list and NVML placement
        order: the order a first-fit allocator walks published devices in."""
        order = self._orders.get(geometry)
        if order is None:
            pairs = ((p.id, pl.start) for p in geometry.model.profiles for pl in p.placements)
            order = {pair: i for i, pair in enumerate(pairs)}
            self._orders[geometry] = order
        return order

    def _rank(  # noqa: PLR0917 -- one candidate's facts, always passed together
        self, gpu: GpuRecord, occupancy: Occupancy, busy: bool, loss: int, pid: int, start: int
    ) -> tuple[object, ...]:
        """Order of single-device candidates.

        First the GPU model's utilization band (5% steps): a request that several models can
        serve goes to the one with the most room left, so the scarce model keeps its capacity
        for the requests only it can serve (on the packing benchmark this is worth more than
        any choice inside a model). Then the smallest loss, then GPUs and nodes in use, then a
        fixed order of model and state so that equal situations decide identically."""
        model_key = gpu.inventory.model.key
        return (
            int(self.model.utilization(model_key) * _PRESSURE_BANDS),
            loss,
            not occupancy.in_use,
            not busy,
            model_key,
            occupancy.state.instances,
            pid,
            start,
        )

    # ------------------------------------------------------------------------------------------
    # Solving

    def _over_result_limit(self, placement: Placement) -> NoPlacement | None:
        """A claim's allocation holds at most 32 results (an API limit), which allocationMode
        All can exceed on a large node."""
        counts = Counter(c.claim for c in placement.choices)
        for claim, n in sorted(counts.items()):
            if n > MAX_RESULTS_PER_CLAIM:
                return NoPlacement(
                    NoPlacementReason.INSUFFICIENT_DEVICES,
                    f"claim {claim} would get {n} devices; an allocation holds at most "
                    f"{MAX_RESULTS_PER_CLAIM}",
                )
        return None

    def _place_slots(
        self, request: PlacementRequest, slots: list[_Slot], constraints: list[_Constraint]
    ) -> Placement | NoPlacement | None:
        if len(slots) > MAX_DEVICES_PER_POD:
            return None
        single = (
            len(slots) == 1
            and not slots[0].all_mode
            and not any(c.covers(slots[0]) for c in constraints)
            and not self._identity_dependent(slots[0].alternative.spec)
            and request.node is None
        )
        if single:
            return self._place_single(request, slots[0])
        return self._place_general(request, slots, constraints)

    def _fits_node(
        self, needs: PodNeeds, node: str, cache: dict[str, NodeMisfit | None]
    ) -> NodeMisfit | None:
        if node not in cache:
            info = self.model.nodes.get(node)
            if info is None:
                cache[node] = NodeMisfit(node, MisfitReason.UNKNOWN)
            else:
                cache[node] = check_node(needs, info, self.model.node_usage(node))
        return cache[node]

    def _place_single(self, request: PlacementRequest, slot: _Slot) -> Placement | NoPlacement:
        """One device, no constraints: scan the (kind, occupancy, node busy) buckets.

        Per bucket the work is two dictionary look-ups (eligibility per kind, best candidate
        per (model, state)); GPUs are only visited for the winning buckets, in node order,
        until one sits on a node that passes node fit."""
        spec = slot.alternative.spec
        options: list[tuple[tuple[object, ...], int, int, int, list[tuple[str, str]]]] = []
        per_kind: dict[int, tuple[GpuRecord, frozenset[tuple[int, int]]]] = {}
        first_fit = self.policy is Policy.FIRST_FIT
        for (kind, occupancy, busy), members in self.model.buckets.items():
            known = per_kind.get(kind)
            if known is None:
                gpu = self.model.gpus[members[0][1]]
                eligible = self._eligible(spec, gpu)
                if isinstance(eligible, CelError):
                    return self._cel_failure(slot.claim, slot.alternative, eligible)
                known = per_kind[kind] = (gpu, eligible)
            gpu, eligible = known
            if not eligible:
                continue
            cands = self._candidates(gpu, occupancy, eligible)
            if not cands:
                continue
            _, loss, pid, start, _ = cands[0]
            if first_fit:
                rank: tuple[object, ...] = (members[0],)
            else:
                rank = self._rank(gpu, occupancy, busy, loss, pid, start)
            options.append((rank, loss, pid, start, members))
        if not any(eligible for _, eligible in per_kind.values()):
            return self._no_device(slot)
        misfits: dict[str, NodeMisfit | None] = {}
        if first_fit:
            # First GPU in (node, uuid) order across all buckets with room.
            streams = [_stream(o[4], o[2], o[3], o[1]) for o in options]
            for node, uuid, pid, start, loss in heapq.merge(*streams):
                if self._fits_node(request.needs, node, misfits) is None:
                    return self._single_result(slot, self.model.gpus[uuid], pid, start, loss)
        else:
            heapq.heapify(options)
            while options:
                _, loss, pid, start, members = heapq.heappop(options)
                for node, uuid in members:
                    if self._fits_node(request.needs, node, misfits) is None:
                        return self._single_result(slot, self.model.gpus[uuid], pid, start, loss)
        return self._explain(request, [slot], misfits)

    def _single_result(
        self, slot: _Slot, gpu: GpuRecord, pid: int, start: int, loss: int
    ) -> Placement:
        choice = self._choice(slot, gpu, pid, start)
        return Placement(gpu.node, (choice,), loss)

    def _choice(self, slot: _Slot, gpu: GpuRecord, pid: int, start: int) -> DeviceChoice:
        device = gpu.by_placement[(pid, start)]
        profile = "gpu" if pid == WHOLE_GPU else gpu.inventory.model.profile_by_id(pid).name
        return DeviceChoice(
            claim=slot.claim,
            request=slot.alternative.result_name,
            driver=self.driver,
            pool=gpu.inventory.pool,
            device=device.name,
            node=gpu.node,
            gpu_uuid=gpu.uuid,
            profile_id=pid,
            start=start,
            profile=profile,
        )

    def _place_general(
        self, request: PlacementRequest, slots: list[_Slot], constraints: list[_Constraint]
    ) -> Placement | NoPlacement:
        misfits: dict[str, NodeMisfit | None] = {}
        nodes = [request.node] if request.node is not None else sorted(self.model.gpu_nodes())
        groups: dict[tuple[object, ...], list[str]] = {}
        identity = any(self._identity_dependent(s.alternative.spec) for s in slots)
        attrs = sorted({c.constraint.attribute for c in constraints})
        for node in nodes:
            if self._fits_node(request.needs, node, misfits) is not None:
                continue
            gpus = self.model.gpus_on(node)
            if not gpus:
                continue
            sig: tuple[object, ...] = (
                self.model.node_busy(node),
                tuple((g.kind, g.occupancy) for g in gpus),
                tuple(self._pattern(a, gpus) for a in attrs),
                tuple(g.uuid for g in gpus) if identity else (),
            )
            groups.setdefault(sig, []).append(node)
        shape = (
            tuple(
                (s.claim_index, s.request, s.alternative, self._selectors(s.alternative.spec))
                for s in slots
            ),
            tuple((c.claim_index, c.constraint) for c in constraints),
        )
        best: tuple[tuple[object, ...], str, list[list[_Pick]], int] | None = None
        exhausted = False
        for sig, members in groups.items():
            gpus = self.model.gpus_on(members[0])
            solved = self._solve_cached(shape, sig, gpus, slots, constraints)
            if isinstance(solved, NoPlacement):
                return solved
            if solved == _EXHAUSTED:
                exhausted = True
                continue
            if not isinstance(solved, tuple):
                continue
            picks, loss = solved
            node = members[0]
            if self.policy is Policy.BEST_FIT:
                band = max(
                    int(self.model.utilization(gpus[pos].inventory.model.key) * _PRESSURE_BANDS)
                    for slot_picks in picks
                    for pos, _, _ in slot_picks
                )
                rank: tuple[object, ...] = (band, loss, not sig[0], node)
            else:
                rank = (node,)
            if best is None or rank < best[0]:
                best = (rank, node, picks, loss)
        if best is None:
            return self._explain(request, slots, misfits, exhausted=exhausted)
        _, node, picks, loss = best
        gpus = self.model.gpus_on(node)
        choices = tuple(
            self._choice(slot, gpus[pos], pid, start)
            for slot, slot_picks in zip(slots, picks, strict=True)
            for pos, pid, start in slot_picks
        )
        return Placement(node, choices, loss)

    def _solve_cached(
        self,
        shape: tuple[object, ...],
        sig: tuple[object, ...],
        gpus: list[GpuRecord],
        slots: list[_Slot],
        constraints: list[_Constraint],
    ) -> tuple[list[list[_Pick]], int] | NoPlacement | str | None:
        """A node signature's solution for this request shape, remembered across decisions:
        most nodes do not change between two decisions, and pods of one workload share a
        shape. The key holds everything the search reads (kinds, occupancies, constraint
        patterns, requests with their class selectors), so an entry is never stale."""
        key = (shape, sig)
        if key in self._solutions:
            return self._solutions[key]
        try:
            solved: tuple[list[list[_Pick]], int] | NoPlacement | str | None = self._solve_node(
                gpus, slots, constraints
            )
        except _BudgetExhaustedError:
            solved = _EXHAUSTED
        if isinstance(solved, NoPlacement):
            return solved  # a selector error: reported, not remembered
        if len(self._solutions) >= _CACHE_LIMIT // 10:
            self._solutions.clear()
        self._solutions[key] = solved
        return solved

    def _solve_node(
        self, gpus: list[GpuRecord], slots: list[_Slot], constraints: list[_Constraint]
    ) -> tuple[list[list[_Pick]], int] | NoPlacement | None:
        eligible: list[list[frozenset[tuple[int, int]]]] = []
        for slot in slots:
            row = []
            for g in gpus:
                e = self._eligible(slot.alternative.spec, g)
                if isinstance(e, CelError):
                    return self._cel_failure(slot.claim, slot.alternative, e)
                row.append(e)
            eligible.append(row)
        search = _Search(
            gpus,
            slots,
            constraints,
            eligible,
            [g.occupancy for g in gpus],
            [[] for _ in slots],
            self.search_budget,
        )
        loss = self._dfs(search, 0, 0)
        if loss is None:
            return None
        return [list(p) for p in search.picks], loss

    def _dfs(self, search: _Search, index: int, loss: int) -> int | None:
        slots = search.slots
        if index == len(slots):
            return loss
        search.budget -= 1
        if search.budget < 0:
            raise _BudgetExhaustedError
        slot = slots[index]
        if slot.all_mode:
            return self._dfs_all(search, index, loss)
        floor: _Pick | None = None
        if index > 0 and slots[index - 1] == slot:
            floor = search.picks[index - 1][0]  # same request slot: pick in increasing order
        candidates = []
        for pos, gpu in enumerate(search.gpus):
            for key, cand_loss, pid, start, nxt in self._candidates(
                gpu, search.occupancy[pos], search.eligible[index][pos]
            ):
                pick = (pos, pid, start)
                if floor is not None and pick <= floor:
                    continue
                candidates.append(((key, pos), cand_loss, pick, nxt))
        candidates.sort(key=lambda c: c[0])
        for _, cand_loss, pick, nxt in candidates:
            pos, pid, start = pick
            if not self._constraints_ok(search, index, [pick]):
                continue
            old = search.occupancy[pos]
            search.occupancy[pos] = nxt
            search.picks[index] = [pick]
            total = self._dfs(search, index + 1, loss + cand_loss)
            if total is not None:
                return total
            search.occupancy[pos] = old
            search.picks[index] = []
        return None

    def _dfs_all(self, search: _Search, index: int, loss: int) -> int | None:
        """allocationMode All: every matching device on the node, all of them free together."""
        picks = [
            (pos, pid, start)
            for pos in range(len(search.gpus))
            for pid, start in sorted(search.eligible[index][pos])
        ]
        if not picks:
            return None
        saved = list(search.occupancy)
        added = 0
        for pos, pid, start in picks:
            gpu = search.gpus[pos]
            nxt = self._after(gpu.geometry, search.occupancy[pos], pid, start)
            if nxt is None:
                search.occupancy[:] = saved
                return None
            added += self._value(gpu.geometry, search.occupancy[pos]) - self._value(
                gpu.geometry, nxt
            )
            search.occupancy[pos] = nxt
        if not self._constraints_ok(search, index, picks):
            search.occupancy[:] = saved
            return None
        search.picks[index] = picks
        total = self._dfs(search, index + 1, loss + added)
        if total is None:
            search.occupancy[:] = saved
            search.picks[index] = []
        return total

    def _constraints_ok(self, search: _Search, index: int, new: list[_Pick]) -> bool:
        slots = search.slots
        slot = slots[index]
        for c in search.constraints:
            if not c.covers(slot):
                continue
            attr = c.constraint.attribute
            values: list[AttributeValue] = []
            for pos, pid, start in new:
                v = search.gpus[pos].by_placement[(pid, start)].facts.attribute(attr)
                if v is None:
                    return False
                values.append(v)
            earlier: list[AttributeValue] = []
            for j in range(index):
                if c.covers(slots[j]):
                    for pos, pid, start in search.picks[j]:
                        v = search.gpus[pos].by_placement[(pid, start)].facts.attribute(attr)
                        if v is not None:
                            earlier.append(v)
            if c.constraint.kind is ConstraintKind.MATCH:
                if any(v != values[0] for v in values) or any(v != values[0] for v in earlier):
                    return False
            elif len(set(values)) != len(values) or set(values) & set(earlier):
                return False
        return True

    def _pattern(self, attribute: str, gpus: list[GpuRecord]) -> tuple[object, ...]:
        """How a constraint attribute's values repeat across a node's devices, with the values
        renamed by first appearance. Nodes with equal kinds and equal patterns are
        interchangeable under the constraint, so they are solved once."""
        seen: dict[object, int] = {}
        out: list[object] = []
        for g in gpus:
            local, distinct = self._local_pattern(g, attribute)
            out.append((local, tuple(seen.setdefault(v, len(seen)) for v in distinct)))
        return tuple(out)

    def _local_pattern(
        self, gpu: GpuRecord, attribute: str
    ) -> tuple[tuple[int, ...], tuple[object, ...]]:
        """Per device (inventory order) the index of its value among the GPU's distinct values,
        and those values; cached per published inventory."""
        key = (gpu.uuid, attribute)
        hit = self._patterns.get(key)
        if hit is not None and hit[0] is gpu.inventory:
            return hit[1], hit[2]
        index: dict[object, int] = {}
        local = tuple(
            index.setdefault(d.facts.attribute(attribute), len(index))
            for d in gpu.inventory.devices
        )
        distinct = tuple(index)
        if len(self._patterns) >= _CACHE_LIMIT:
            self._patterns.clear()
        self._patterns[key] = (gpu.inventory, local, distinct)
        return local, distinct

    # ------------------------------------------------------------------------------------------
    # Explanations

    def _room(
        self, geometry: Geometry, occupancy: Occupancy, eligible: frozenset[tuple[int, int]]
    ) -> tuple[tuple[int, bool, str | None], ...]:
        """Per eligible profile: whether it fits now, else the name of a profile whose
        instances, once gone, would make room. Memoized per (model, occupancy, eligible)."""
        key = (geometry, occupancy, eligible)
        hit = self._room_cache.get(key)
        if hit is not None:
            return hit
        out: list[tuple[int, bool, str | None]] = []
        for pid in sorted({pid for pid, _ in eligible}):
            starts = [s for p, s in eligible if p == pid]
            if any(self._after(geometry, occupancy, pid, s) for s in starts):
                out.append((pid, True, None))
                continue
            freeing = None
            if not occupancy.blocked:
                for q in sorted({q for q, _ in occupancy.state.instances}):
                    state = occupancy.state
                    for inst in [i for i in state.instances if i[0] == q]:
                        state = geometry.remove(state, *inst)
                    if pid == WHOLE_GPU:
                        ok = not state.instances
                    else:
                        ok = any(geometry.fits(state, pid, s) for s in starts)
                    if ok:
                        freeing = _profile_name(geometry, q)
                        break
            out.append((pid, False, freeing))
        result = tuple(out)
        if len(self._room_cache) >= _CACHE_LIMIT:
            self._room_cache.clear()
        self._room_cache[key] = result
        return result

    def _no_device(self, slot: _Slot) -> NoPlacement:
        spec = slot.alternative.spec
        return NoPlacement(
            NoPlacementReason.NO_MATCHING_DEVICE,
            f"claim {slot.claim} request {slot.alternative.result_name}: no device published "
            f"in the cluster matches DeviceClass {spec.device_class}"
            + (f" and {len(spec.selectors)} selector(s)" if spec.selectors else "")
            + (" and the capacity requests" if spec.capacity else ""),
        )

    def _explain(
        self,
        request: PlacementRequest,
        slots: Sequence[_Slot],
        misfits: Mapping[str, NodeMisfit | None],
        *,
        exhausted: bool = False,
    ) -> NoPlacement:
        bad_nodes = {n: m for n, m in misfits.items() if m is not None}
        gpu_nodes = list(self.model.gpu_nodes()) if request.node is None else [request.node]
        if not gpu_nodes:
            return NoPlacement(NoPlacementReason.NO_NODE, "no node publishes carve GPUs")
        parts = []
        for (claim, result), count in Counter(
            (s.claim, s.alternative.result_name) for s in slots
        ).items():
            slot = next(
                s for s in slots if s.claim == claim and s.alternative.result_name == result
            )
            hint = self._capacity_hint(slot.alternative.spec)
            many = f"{count} devices" if count > 1 else "a device"
            parts.append(f"{claim} request {result} needs {many}" + (f" ({hint})" if hint else ""))
        if len(slots) == 1 and not bad_nodes:
            return NoPlacement(
                NoPlacementReason.INSUFFICIENT_DEVICES, f"no free placement: {parts[0]}"
            )
        reasons = Counter(m.reason.value for m in bad_nodes.values())
        node_text = ", ".join(f"{n} node(s) {r}" for r, n in sorted(reasons.items()))
        detail = "; ".join(parts)
        fit = len(gpu_nodes) - len(bad_nodes)
        message = f"0/{len(gpu_nodes)} GPU nodes can take the pod"
        if node_text:
            message += f": {node_text}"
        if fit:
            message += f"; {fit} node(s) lack room for all its devices: {detail}"
        if exhausted:
            message += " (search limit reached on some nodes)"
        reason = (
            NoPlacementReason.NODE_MISFIT if not fit else NoPlacementReason.INSUFFICIENT_DEVICES
        )
        if len(bad_nodes) == 1 and fit == 0:
            message = next(iter(bad_nodes.values())).message
        return NoPlacement(reason, message)

    def _capacity_hint(self, spec: ExactRequest) -> str:
        """e.g. "no H100-SXM5-80GB GPU has a free 3g.40gb placement; 2 would after 1g.10gb
        pods finish", for each (model, profile) the request could use that has no room now."""
        free: Counter[tuple[str, int]] = Counter()
        after: dict[tuple[str, int], Counter[str]] = {}
        after_count: Counter[tuple[str, int]] = Counter()
        models: dict[str, Geometry] = {}
        per_kind: dict[int, frozenset[tuple[int, int]]] = {}
        for (kind, occupancy, _), members in self.model.buckets.items():
            gpu = self.model.gpus[members[0][1]]
            eligible = per_kind.get(kind)
            if eligible is None:
                found = self._eligible(spec, gpu)
                if isinstance(found, CelError):
                    return found.message
                eligible = per_kind[kind] = found
            geometry = gpu.geometry
            model_key = geometry.model.key
            models[model_key] = geometry
            for pid, room, freeing in self._room(geometry, occupancy, eligible):
                key = (model_key, pid)
                free[key] += len(members) if room else 0
                if freeing is not None:
                    after.setdefault(key, Counter())[freeing] += 1
                    after_count[key] += len(members)
        texts = []
        for (model_key, pid), n in sorted(free.items()):
            if n:
                continue
            name = _profile_name(models[model_key], pid)
            text = f"no {model_key} GPU has a free {name} placement"
            if after_count[(model_key, pid)]:
                names = ", ".join(sorted(after[(model_key, pid)]))
                text += f"; {after_count[(model_key, pid)]} would after {names} pods finish"
            texts.append(text)
        return "; ".join(texts)


def _stream(
    members: list[tuple[str, str]], pid: int, start: int, loss: int
) -> Iterator[tuple[str, str, int, int, int]]:
    """A bucket's GPUs in (node, uuid) order, each with the bucket's candidate placement."""
    for node, uuid in members:
        yield node, uuid, pid, start, loss


def _profile_name(geometry: Geometry, pid: int) -> str:
    if pid == WHOLE_GPU:
        return "whole-GPU"
    return geometry.model.profile_by_id(pid).name
