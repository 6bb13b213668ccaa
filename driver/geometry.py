"""MIG geometry: which GPU instances can coexist on one GPU.

A GPU's MIG state is small: a handful of instances, each a (profile, placement) pair. The number
of distinct states per GPU model is in the thousands at most, while a cluster has thousands of
GPUs and the placement engine asks the same questions about them again and again. So every
answer about a state (which placements fit, how many more of each profile it admits, the state
after a create or destroy) is computed once per (model, state) and then looked up.

The rules follow the reference (mig-and-nvml.md section 5) and use only the fields of the
`GpuModel` given, because on real hardware the model comes from NVML discovery, not the catalog:

1. a placement occupies memory units [start, start + size) and may not overlap another;
2. only the placements NVML lists for a profile are valid;
3. engines (copy engines, decoders, encoders, JPEG, OFA) are counted pools whose totals are the
   full-size profile's row: one OFA means one `+me` (or the 7g) at a time; A100 and A30 have a
   single JPEG;
4. while a `+me.all` instance exists only `-me` profiles can be created, and a `+me.all` can only
   be created beside `-me` instances;
5. a profile never has more than its `max_instances` instances.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from driver.catalog import NO_ENGINES, Engines, GpuModel, ProfileSpec

__all__ = [
    "EMPTY_STATE",
    "Geometry",
    "GpuState",
    "PlacementError",
    "PlacementFailure",
    "geometry_for",
]


@dataclass(frozen=True)
class GpuState:
    """The GPU instances on one GPU, canonical and hashable.

    `instances` is sorted (profile_id, placement_start); `occupied` and `engines` are derived from
    it for the model the state belongs to and are kept so that fit checks need no model lookup.
    Build states through `Geometry.place`/`remove`/`state_of`, which keep the three consistent.
    """

    instances: tuple[tuple[int, int], ...]
    occupied: int  # bit i set when memory unit i is in use
    engines: Engines  # engines in use

    # States are dictionary keys in every cache; hashing a nested tuple and a dataclass on every
    # look-up would dominate a fit check, so the hash is computed once per object.
    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.instances, self.occupied))

    def count(self, profile_id: int) -> int:
        """Instances of `profile_id` in this state."""
        return sum(1 for pid, _ in self.instances if pid == profile_id)


EMPTY_STATE = GpuState((), 0, NO_ENGINES)


class PlacementFailure(StrEnum):
    """Why a create or destroy is refused; lets callers map to NVML codes without parsing text.

    NVML returns INVALID_ARGUMENT for UNKNOWN_PROFILE and UNLISTED_PLACEMENT, and
    INSUFFICIENT_RESOURCES for OVERLAP, ENGINES, MAX_INSTANCES and ALL_MEDIA.
    """

    UNKNOWN_PROFILE = "unknown-profile"
    UNLISTED_PLACEMENT = "unlisted-placement"
    OVERLAP = "overlap"
    ENGINES = "engines"
    MAX_INSTANCES = "max-instances"
    ALL_MEDIA = "all-media"
    ABSENT = "absent"


class PlacementError(ValueError):
    """A GPU instance cannot be created or destroyed; the message says exactly why."""

    def __init__(self, reason: PlacementFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# Engines are packed into one int, 16 bits per pool, so the pool check of a fit is a single
# subtraction and mask: (totals + GUARD - demand - used) keeps every lane's guard bit set exactly
# when each pool has room (lanes never borrow because counts stay far below 0x8000).
_LANE = 16
_GUARD = sum(0x8000 << (_LANE * i) for i in range(5))
_ENGINE_NAMES = ("copy engines", "decoders", "encoders", "JPEG engines", "OFA engines")


def _pack(e: Engines) -> int:
    return (
        e.copy
        | e.decoders << _LANE
        | e.encoders << (2 * _LANE)
        | e.jpeg << (3 * _LANE)
        | e.ofa << (4 * _LANE)
    )


def _units(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


@dataclass(frozen=True)
class _Profile:
    """One profile with everything a fit check needs precomputed."""

    spec: ProfileSpec
    masks: tuple[tuple[int, int], ...]  # (start, mask) in NVML placement order
    mask_at: Mapping[int, int]
    demand: int  # packed engines
    slack: int  # packed totals + GUARD - demand: fits iff (slack - used) & GUARD == GUARD
    all_media: bool
    no_media: bool


@dataclass
class _Facts:
    """Everything known about one state; built once, then read."""

    feasible: dict[int, tuple[int, ...]]
    feasible_set: frozenset[tuple[int, int]]
    admits: Mapping[int, int]
    children: dict[tuple[int, int], GpuState] = field(default_factory=dict)


class Geometry:
    """The MIG placement rules of one GPU model, with per-state answers cached.

    Safe to share between threads: caches only ever gain equal answers, so a race at worst
    computes one twice.
    """

    # States per model are few; the cap only guards against callers feeding endless garbage.
    _MAX_CACHED_STATES = 1 << 16

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        totals = _pack(model.engine_totals)
        profiles: dict[int, _Profile] = {}
        for spec in model.profiles:
            masks = tuple((p.start, p.mask) for p in spec.placements)
            demand = _pack(spec.engines)
            profiles[spec.id] = _Profile(
                spec=spec,
                masks=masks,
                mask_at=MappingProxyType(dict(masks)),
                demand=demand,
                slack=totals + _GUARD - demand,
                all_media=spec.takes_all_media,
                no_media=spec.without_media,
            )
        self._profiles: Mapping[int, _Profile] = MappingProxyType(profiles)
        self._all_media_ids = frozenset(pid for pid, p in profiles.items() if p.all_media)
        self._no_media_ids = frozenset(pid for pid, p in profiles.items() if p.no_media)
        self._facts: dict[GpuState, _Facts] = {}

    def __repr__(self) -> str:
        return f"Geometry({self.model.key})"

    @property
    def profile_ids(self) -> tuple[int, ...]:
        """Profile ids in the model's order."""
        return tuple(self._profiles)

    # ---- queries -------------------------------------------------------------------------

    def fits(self, state: GpuState, profile_id: int, start: int) -> bool:
        """Whether a GPU instance of `profile_id` can be created at `start` now."""
        return (profile_id, start) in self._facts_of(state).feasible_set

    def feasible_starts(self, state: GpuState, profile_id: int) -> tuple[int, ...]:
        """Starts where `profile_id` fits now, in NVML's placement order; () if unknown."""
        return self._facts_of(state).feasible.get(profile_id, ())

    def remaining_capacity(self, state: GpuState, profile_id: int) -> int:
        """How many more instances of `profile_id` could be created one after another, as
        nvmlDeviceGetGpuInstanceRemainingCapacity reports; 0 for an unknown profile."""
        return self._facts_of(state).admits.get(profile_id, 0)

    def admits(self, state: GpuState) -> Mapping[int, int]:
        """profile_id -> remaining capacity for every profile of the model, cached per state."""
        return self._facts_of(state).admits

    # ---- transitions ---------------------------------------------------------------------

    def place(self, state: GpuState, profile_id: int, start: int) -> GpuState:
        """The state after creating `profile_id` at `start`; PlacementError says why not."""
        facts = self._facts_of(state)
        key = (profile_id, start)
        child = facts.children.get(key)
        if child is not None:
            return child
        if key not in facts.feasible_set:
            raise self._refusal(state, profile_id, start)
        p = self._profiles[profile_id]
        child = GpuState(
            instances=tuple(sorted((*state.instances, key))),
            occupied=state.occupied | p.mask_at[start],
            engines=state.engines + p.spec.engines,
        )
        facts.children[key] = child
        return child

    def remove(self, state: GpuState, profile_id: int, start: int) -> GpuState:
        """The state after destroying the instance of `profile_id` at `start`."""
        key = (profile_id, start)
        if key not in state.instances:
            held = ", ".join(self._describe(pid, s) for pid, s in state.instances) or "none"
            raise PlacementError(
                PlacementFailure.ABSENT,
                f"no {self._describe(profile_id, start)} instance on this {self.model.key} GPU "
                f"(instances: {held})",
            )
        p = self._profiles.get(profile_id)
        if p is None or start not in p.mask_at:
            raise PlacementError(
                PlacementFailure.UNKNOWN_PROFILE,
                f"{self._describe(profile_id, start)} is not a placement of {self.model.key}; "
                "the state does not belong to this GPU model",
            )
        rest = list(state.instances)
        rest.remove(key)
        return GpuState(
            instances=tuple(rest),
            occupied=state.occupied & ~p.mask_at[start],
            engines=state.engines - p.spec.engines,
        )

    def state_of(self, instances: Iterable[tuple[int, int]]) -> GpuState:
        """The state holding `instances` (profile_id, start), checked by creating them in order.

        Use it to rebuild a state from an NVML listing or a ResourceSlice allocation; it raises
        PlacementError if the instances cannot coexist. Instances are created largest first, so
        a valid set never fails because of the order it is listed in.
        """
        state = EMPTY_STATE
        order = sorted(instances, key=lambda k: (-self._size_of(k[0]), k))
        for pid, start in order:
            state = self.place(state, pid, start)
        return state

    # ---- internals -----------------------------------------------------------------------

    def _size_of(self, profile_id: int) -> int:
        p = self._profiles.get(profile_id)
        return p.spec.size if p is not None else 0

    def _facts_of(self, state: GpuState) -> _Facts:
        facts = self._facts.get(state)
        if facts is None:
            facts = self._compute(state)
            if len(self._facts) >= self._MAX_CACHED_STATES:
                self._facts.clear()
            self._facts[state] = facts
        return facts

    def _media_allows(self, state: GpuState, p: _Profile) -> bool:
        if p.no_media:
            return True
        pids = [pid for pid, _ in state.instances]
        if any(pid in self._all_media_ids for pid in pids):
            return False
        return not p.all_media or all(pid in self._no_media_ids for pid in pids)

    def _compute(self, state: GpuState) -> _Facts:
        used = _pack(state.engines)
        feasible: dict[int, tuple[int, ...]] = {}
        admits: dict[int, int] = {}
        for pid, p in self._profiles.items():
            count = state.count(pid)
            if (
                count >= p.spec.max_instances
                or (p.slack - used) & _GUARD != _GUARD
                or not self._media_allows(state, p)
            ):
                feasible[pid] = ()
                admits[pid] = 0
                continue
            occupied = state.occupied
            feasible[pid] = tuple(s for s, m in p.masks if not occupied & m)
            # Greedy in placement order, as repeated creates without a placement would go.
            # One pass suffices: a start skipped because it overlaps stays overlapped.
            # An `+me.all` admits at most one: its own presence blocks the next.
            more, eng = 0, used
            for _, m in p.masks:
                if occupied & m:
                    continue
                if count + more >= p.spec.max_instances or (p.slack - eng) & _GUARD != _GUARD:
                    break
                occupied |= m
                eng += p.demand
                more += 1
                if p.all_media:
                    break
            admits[pid] = more
        return _Facts(
            feasible=feasible,
            feasible_set=frozenset((pid, s) for pid, starts in feasible.items() for s in starts),
            admits=MappingProxyType(admits),
        )

    def _describe(self, profile_id: int, start: int) -> str:
        p = self._profiles.get(profile_id)
        name = p.spec.name if p is not None else "unknown profile"
        return f"{name} (id {profile_id}) at {start}"

    def _refusal(self, state: GpuState, profile_id: int, start: int) -> PlacementError:
        """Build the most specific reason a create is refused (checked in NVML's order)."""
        key = self.model.key
        p = self._profiles.get(profile_id)
        if p is None:
            return PlacementError(
                PlacementFailure.UNKNOWN_PROFILE,
                f"{key} has no GPU-instance profile with id {profile_id}; "
                f"profile ids: {', '.join(map(str, self._profiles))}",
            )
        what = self._describe(profile_id, start)
        mask = p.mask_at.get(start)
        if mask is None:
            return PlacementError(
                PlacementFailure.UNLISTED_PLACEMENT,
                f"{what}: start {start} is not a listed placement on {key}; "
                f"valid starts: {', '.join(str(s) for s, _ in p.masks)}",
            )
        if state.occupied & mask:
            holders = [
                self._describe(pid, s)
                for pid, s in state.instances
                if self._profiles[pid].mask_at.get(s, 0) & mask
            ]
            units = ", ".join(map(str, _units(state.occupied & mask)))
            return PlacementError(
                PlacementFailure.OVERLAP,
                f"{what} overlaps memory units {units} held by {'; '.join(holders)}",
            )
        count = state.count(profile_id)
        if count >= p.spec.max_instances:
            return PlacementError(
                PlacementFailure.MAX_INSTANCES,
                f"{what}: {key} allows at most {p.spec.max_instances} instance(s) of "
                f"{p.spec.name} and {count} exist",
            )
        if not self._media_allows(state, p):
            blockers = [
                self._describe(pid, s)
                for pid, s in state.instances
                if pid in self._all_media_ids or (p.all_media and pid not in self._no_media_ids)
            ]
            return PlacementError(
                PlacementFailure.ALL_MEDIA,
                f"{what}: a +me.all instance takes every media engine, so only -me profiles "
                f"can share the GPU with it (conflicts with {'; '.join(blockers)})",
            )
        totals = self.model.engine_totals
        short = [
            f"{need} of {name} with {total - used} of {total} free"
            for name, need, used, total in zip(
                _ENGINE_NAMES,
                p.spec.engines.counts(),
                state.engines.counts(),
                totals.counts(),
                strict=True,
            )
            if used + need > total
        ]
        return PlacementError(
            PlacementFailure.ENGINES,
            f"{what} needs {', '.join(short) or 'engines that are in use'}",
        )


@functools.cache
def _geometry_by_value(model: GpuModel) -> Geometry:
    return Geometry(model)


# Hashing a GpuModel walks every profile; callers ask per GPU per decision, so the common case
# (the same model object again) is answered by identity. Entries keep their model alive, so an
# id is never reused while cached.
_BY_IDENTITY: dict[int, tuple[GpuModel, Geometry]] = {}


def geometry_for(model: GpuModel) -> Geometry:
    """The shared Geometry of `model`: one per distinct model value, so caches are shared by
    every GPU of that model (including equal models discovered separately)."""
    hit = _BY_IDENTITY.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    geometry = _geometry_by_value(model)
    if len(_BY_IDENTITY) < 4096:
        _BY_IDENTITY[id(model)] = (model, geometry)
    return geometry
