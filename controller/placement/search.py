"""Finding a node and placements for a set of request slots; the policy decides the order.

Two paths with the same answers (a test checks that they agree):

- **single device, no constraint** (the common case): the model indexes GPUs by (kind,
  occupancy, node busy), so the scan costs the number of distinct buckets, two cached look-ups
  each (eligibility per kind, best candidate per state); GPUs are only visited for the winning
  buckets, until one sits on a node that passes node fit;
- **several devices** (several requests or claims, ``count`` > 1, ``allocationMode: All``,
  constraints, a pinned node, identity selectors): a bounded depth-first search per node. Nodes
  whose GPUs are in the same states (and whose constrained attributes repeat the same way) are
  solved once, and solutions are remembered across decisions, because most nodes do not change
  between two decisions and pods of one workload share a request shape.

The search never changes the model and never words a refusal: it answers a :class:`Found`, or
why not (:class:`NoFit`, :class:`NoEligibleDevice`, :class:`SelectorFailed`) for
:mod:`.explain` to put into words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from controller.claims import ConstraintKind
from controller.model import ClusterModel, GpuInventory, GpuRecord, Occupancy
from controller.nodefit import MisfitReason, NodeMisfit, PodNeeds, check_node
from controller.placement.cache import DEFAULT_MAX_ENTRIES, BoundedCache
from controller.placement.eligibility import Eligibility, SelectorFailure
from controller.placement.feasibility import occupancy_after
from controller.placement.records import (
    BucketOption,
    DeviceSet,
    Found,
    FoundDevice,
    Pick,
    ScopedConstraint,
    Slot,
)
from controller.placement.scoring import CandidateTable, GpuValues, PackingPolicy
from driver.cel import AttributeValue

Misfits = dict[str, NodeMisfit | None]
"""Node-fit verdicts of one decision, per node looked at (None: the node fits)."""


@dataclass(frozen=True)
class NoFit:
    """No node has room: ``misfits`` says which nodes node fit refused; ``exhausted`` that the
    search gave up on some node before it had tried everything."""

    misfits: Mapping[str, NodeMisfit | None]
    exhausted: bool = False


@dataclass(frozen=True)
class NoEligibleDevice:
    """No published device anywhere matches the slot's class, capacity and selectors."""

    slot: Slot


@dataclass(frozen=True)
class SelectorFailed:
    """A selector of the slot's request could not be judged on some device."""

    slot: Slot
    failure: SelectorFailure


Outcome = Found | NoFit | NoEligibleDevice | SelectorFailed


@dataclass(frozen=True)
class _Solved:
    """A node signature's best solution: picks are GPU positions on any node of the group."""

    picks: tuple[tuple[Pick, ...], ...]  # per slot; several for an All slot
    loss: int


class _Unsolved(Enum):
    """Why a node signature has no solution; remembered like a solution."""

    NO_SOLUTION = "no solution"
    BUDGET_EXHAUSTED = "search budget exhausted"


class _Pattern(NamedTuple):
    """How one attribute's values repeat across one GPU's devices (see ``_local_pattern``)."""

    inventory: GpuInventory  # the published inventory the pattern was read from
    local: tuple[int, ...]
    distinct: tuple[object, ...]


class _Move(NamedTuple):
    """A candidate in the search's order: the policy's key, then the GPU's position."""

    order: tuple[object, ...]
    loss: int
    pick: Pick
    after: Occupancy


class _BudgetExhaustedError(Exception):
    """Unwinds a node's search when its step budget is spent (remembered as BUDGET_EXHAUSTED)."""


@dataclass
class _NodeSearch:
    """Mutable state of one node's depth-first search."""

    gpus: list[GpuRecord]
    slots: list[Slot]
    constraints: list[ScopedConstraint]
    eligible: list[list[DeviceSet]]  # per slot, per GPU
    occupancy: list[Occupancy]
    picks: list[list[Pick]]  # per slot; several for an All slot
    budget: int


class Searcher:
    """Runs both paths; see the module docstring. Not thread-safe (one decision at a time)."""

    def __init__(
        self,
        model: ClusterModel,
        eligibility: Eligibility,
        *,
        policy: PackingPolicy,
        values: GpuValues,
        candidates: CandidateTable,
        budget: int,
    ) -> None:
        self._model = model
        self._eligibility = eligibility
        self._policy = policy
        self._values = values
        self._candidates = candidates
        self.budget = budget
        self._solutions: BoundedCache[
            tuple[tuple[object, ...], tuple[object, ...]], _Solved | _Unsolved
        ] = BoundedCache(DEFAULT_MAX_ENTRIES // 10)
        self._patterns: BoundedCache[tuple[str, str], _Pattern] = BoundedCache()

    # ------------------------------------------------------------------------------------------
    # One device

    def place_single(self, needs: PodNeeds, slot: Slot) -> Outcome:
        """One device, no constraints: scan the (kind, occupancy, node busy) buckets."""
        spec = slot.alternative.spec
        options: list[BucketOption] = []
        per_kind: dict[int, tuple[GpuRecord, DeviceSet]] = {}
        for (kind, occupancy, busy), members in self._model.buckets.items():
            known = per_kind.get(kind)
            if known is None:
                gpu = self._model.gpus[members[0][1]]
                eligible = self._eligibility.eligible(spec, gpu)
                if isinstance(eligible, SelectorFailure):
                    return SelectorFailed(slot, eligible)
                known = per_kind[kind] = (gpu, eligible)
            gpu, eligible = known
            if not eligible:
                continue
            cands = self._candidates.candidates(gpu, occupancy, eligible)
            if not cands:
                continue
            best = cands[0]
            rank = self._policy.bucket_rank(gpu, occupancy, busy, best)
            options.append(BucketOption(rank, best.loss, best.profile_id, best.start, members))
        if not any(eligible for _, eligible in per_kind.values()):
            return NoEligibleDevice(slot)
        misfits: Misfits = {}
        for offer in self._policy.offers(options):
            if self._misfit(needs, offer.node, misfits) is None:
                gpu = self._model.gpus[offer.uuid]
                device = FoundDevice(slot, gpu, offer.profile_id, offer.start)
                return Found(gpu.node, (device,), offer.loss)
        return NoFit(misfits)

    def _misfit(self, needs: PodNeeds, node: str, cache: Misfits) -> NodeMisfit | None:
        """Node fit (cordon, taints, affinity, cpu/memory/pods), once per node and decision."""
        if node not in cache:
            info = self._model.nodes.get(node)
            if info is None:
                cache[node] = NodeMisfit(node, MisfitReason.UNKNOWN)
            else:
                cache[node] = check_node(needs, info, self._model.node_usage(node))
        return cache[node]

    # ------------------------------------------------------------------------------------------
    # Several devices

    def place_general(
        self,
        needs: PodNeeds,
        pinned: str | None,
        slots: list[Slot],
        constraints: list[ScopedConstraint],
    ) -> Outcome:
        """Solve each group of interchangeable nodes once; the policy ranks the solutions."""
        misfits: Misfits = {}
        groups = self._interchangeable_nodes(needs, pinned, slots, constraints, misfits)
        shape = self._shape(slots, constraints)
        best: tuple[tuple[object, ...], str, _Solved] | None = None
        exhausted = False
        for sig, members in groups.items():
            gpus = self._model.gpus_on(members[0])
            solved = self._solve_cached(shape, sig, gpus, slots, constraints)
            if isinstance(solved, SelectorFailed):
                return solved
            if solved is _Unsolved.BUDGET_EXHAUSTED:
                exhausted = True
                continue
            if not isinstance(solved, _Solved):
                continue
            node = members[0]
            models = (gpus[p.position].inventory.model.key for picks in solved.picks for p in picks)
            rank = self._policy.solution_rank(node, bool(sig[0]), solved.loss, models)
            if best is None or rank < best[0]:
                best = (rank, node, solved)
        if best is None:
            return NoFit(misfits, exhausted)
        _, node, solved = best
        gpus = self._model.gpus_on(node)
        devices = tuple(
            FoundDevice(slot, gpus[p.position], p.profile_id, p.start)
            for slot, picks in zip(slots, solved.picks, strict=True)
            for p in picks
        )
        return Found(node, devices, solved.loss)

    def _interchangeable_nodes(
        self,
        needs: PodNeeds,
        pinned: str | None,
        slots: list[Slot],
        constraints: list[ScopedConstraint],
        misfits: Misfits,
    ) -> dict[tuple[object, ...], list[str]]:
        """Nodes that pass node fit, grouped by signature: busy, the (kind, occupancy) of each
        GPU, how constrained attributes repeat, and the GPUs themselves when a selector reads
        identity. Nodes of one signature have the same solutions, so each group is solved
        once (for its first node in name order)."""
        nodes = [pinned] if pinned is not None else sorted(self._model.gpu_nodes())
        groups: dict[tuple[object, ...], list[str]] = {}
        identity = any(self._eligibility.identity_dependent(s.alternative.spec) for s in slots)
        attrs = sorted({c.constraint.attribute for c in constraints})
        for node in nodes:
            if self._misfit(needs, node, misfits) is not None:
                continue
            gpus = self._model.gpus_on(node)
            if not gpus:
                continue
            sig: tuple[object, ...] = (
                self._model.node_busy(node),
                tuple((g.kind, g.occupancy) for g in gpus),
                tuple(self._pattern(a, gpus) for a in attrs),
                tuple(g.uuid for g in gpus) if identity else (),
            )
            groups.setdefault(sig, []).append(node)
        return groups

    def _shape(self, slots: list[Slot], constraints: list[ScopedConstraint]) -> tuple[object, ...]:
        """Everything about the request that the search reads, class selectors included (a
        class edited in place must not be answered from an old solution)."""
        return (
            tuple(
                (
                    s.claim_index,
                    s.request,
                    s.alternative,
                    self._eligibility.selectors(s.alternative.spec),
                )
                for s in slots
            ),
            tuple((c.claim_index, c.constraint) for c in constraints),
        )

    def _solve_cached(
        self,
        shape: tuple[object, ...],
        sig: tuple[object, ...],
        gpus: list[GpuRecord],
        slots: list[Slot],
        constraints: list[ScopedConstraint],
    ) -> _Solved | _Unsolved | SelectorFailed:
        """A node signature's solution for this request shape, remembered across decisions.
        The key holds everything the search reads (kinds, occupancies, constraint patterns,
        requests with their class selectors), so an entry is never stale."""
        key = (shape, sig)
        hit = self._solutions.get(key)
        if hit is not None:
            return hit
        try:
            solved = self._solve_node(gpus, slots, constraints)
        except _BudgetExhaustedError:
            solved = _Unsolved.BUDGET_EXHAUSTED
        if isinstance(solved, SelectorFailed):
            return solved  # reported, not remembered
        return self._solutions.put(key, solved)

    def _solve_node(
        self, gpus: list[GpuRecord], slots: list[Slot], constraints: list[ScopedConstraint]
    ) -> _Solved | _Unsolved | SelectorFailed:
        eligible: list[list[DeviceSet]] = []
        for slot in slots:
            row = []
            for g in gpus:
                e = self._eligibility.eligible(slot.alternative.spec, g)
                if isinstance(e, SelectorFailure):
                    return SelectorFailed(slot, e)
                row.append(e)
            eligible.append(row)
        search = _NodeSearch(
            gpus,
            slots,
            constraints,
            eligible,
            [g.occupancy for g in gpus],
            [[] for _ in slots],
            self.budget,
        )
        loss = self._dfs(search, 0, 0)
        if loss is None:
            return _Unsolved.NO_SOLUTION
        return _Solved(tuple(tuple(p) for p in search.picks), loss)

    def _dfs(self, search: _NodeSearch, index: int, loss: int) -> int | None:
        """Slot ``index`` onwards; the total loss of the first complete solution, or None.

        Candidates are tried best first (the policy's order), so the first solution found is
        the one the policy prefers on this node. Slots of the same request pick in increasing
        order, so permutations of one solution are never explored twice."""
        slots = search.slots
        if index == len(slots):
            return loss
        search.budget -= 1
        if search.budget < 0:
            raise _BudgetExhaustedError
        slot = slots[index]
        if slot.all_mode:
            return self._dfs_all(search, index, loss)
        floor: Pick | None = None
        if index > 0 and slots[index - 1] == slot:
            floor = search.picks[index - 1][0]
        moves = []
        for pos, gpu in enumerate(search.gpus):
            for c in self._candidates.candidates(
                gpu, search.occupancy[pos], search.eligible[index][pos]
            ):
                pick = Pick(pos, c.profile_id, c.start)
                if floor is not None and pick <= floor:
                    continue
                moves.append(_Move((c.key, pos), c.loss, pick, c.after))
        moves.sort(key=lambda m: m.order)
        for move in moves:
            if not self._constraints_ok(search, index, [move.pick]):
                continue
            pos = move.pick.position
            old = search.occupancy[pos]
            search.occupancy[pos] = move.after
            search.picks[index] = [move.pick]
            total = self._dfs(search, index + 1, loss + move.loss)
            if total is not None:
                return total
            search.occupancy[pos] = old
            search.picks[index] = []
        return None

    def _dfs_all(self, search: _NodeSearch, index: int, loss: int) -> int | None:
        """allocationMode All: every matching device on the node, all of them free together."""
        picks = [
            Pick(pos, pid, start)
            for pos in range(len(search.gpus))
            for pid, start in sorted(search.eligible[index][pos])
        ]
        if not picks:
            return None
        saved = list(search.occupancy)
        added = 0
        for pick in picks:
            geometry = search.gpus[pick.position].geometry
            before = search.occupancy[pick.position]
            after = occupancy_after(geometry, before, pick.profile_id, pick.start)
            if after is None:
                search.occupancy[:] = saved
                return None
            added += self._values.value(geometry, before) - self._values.value(geometry, after)
            search.occupancy[pick.position] = after
        if not self._constraints_ok(search, index, picks):
            search.occupancy[:] = saved
            return None
        search.picks[index] = picks
        total = self._dfs(search, index + 1, loss + added)
        if total is None:
            search.occupancy[:] = saved
            search.picks[index] = []
        return total

    @staticmethod
    def _constraints_ok(search: _NodeSearch, index: int, new: list[Pick]) -> bool:
        """matchAttribute / distinctAttribute between ``new`` and the earlier slots' picks.

        A device that lacks a constrained attribute cannot satisfy the constraint, as in
        kube-scheduler."""
        slots = search.slots
        slot = slots[index]
        for c in search.constraints:
            if not c.covers(slot):
                continue
            attr = c.constraint.attribute
            values: list[AttributeValue] = []
            for p in new:
                v = (
                    search.gpus[p.position]
                    .by_placement[(p.profile_id, p.start)]
                    .facts.attribute(attr)
                )
                if v is None:
                    return False
                values.append(v)
            earlier: list[AttributeValue] = []
            for j in range(index):
                if c.covers(slots[j]):
                    for p in search.picks[j]:
                        device = search.gpus[p.position].by_placement[(p.profile_id, p.start)]
                        v = device.facts.attribute(attr)
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
            pattern = self._local_pattern(g, attribute)
            out.append(
                (pattern.local, tuple(seen.setdefault(v, len(seen)) for v in pattern.distinct))
            )
        return tuple(out)

    def _local_pattern(self, gpu: GpuRecord, attribute: str) -> _Pattern:
        """Per device (inventory order) the index of its value among the GPU's distinct values,
        and those values; cached per published inventory (a republished GPU is read again)."""
        key = (gpu.uuid, attribute)
        hit = self._patterns.get(key)
        if hit is not None and hit.inventory is gpu.inventory:
            return hit
        index: dict[object, int] = {}
        local = tuple(
            index.setdefault(d.facts.attribute(attribute), len(index))
            for d in gpu.inventory.devices
        )
        return self._patterns.put(key, _Pattern(gpu.inventory, local, tuple(index)))
