"""Named records the engine's modules hand each other (never seen outside the package).

Tuples whose fields were known only by position became these records. The ones that the search
sorts or heap-merges are NamedTuples on purpose: they compare field by field exactly as the
tuples did, so every tie is broken as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from controller.claims import AllocationMode, Alternative, ClaimKey, DeviceConstraint
from controller.model import GpuRecord, Occupancy

DeviceSet = frozenset[tuple[int, int]]
"""(profile id, start) of the devices of one GPU that a (sub)request may use."""


@dataclass(frozen=True)
class Slot:
    """One device to find: a request slot of a claim (or all matching devices for ``All``)."""

    claim_index: int
    claim: ClaimKey
    request: str  # base request name
    alternative: Alternative

    @property
    def all_mode(self) -> bool:
        return self.alternative.spec.mode is AllocationMode.ALL


@dataclass(frozen=True)
class ScopedConstraint:
    """A claim's constraint, tied to the claim's position so it only covers that claim's slots."""

    claim_index: int
    constraint: DeviceConstraint

    def covers(self, slot: Slot) -> bool:
        listed = self.constraint.requests
        return slot.claim_index == self.claim_index and (
            not listed or slot.request in listed or slot.alternative.result_name in listed
        )


class Pick(NamedTuple):
    """One chosen device on a node: the GPU's position among the node's GPUs and a placement."""

    position: int
    profile_id: int
    start: int


class Candidate(NamedTuple):
    """A feasible placement on one GPU state: the policy's sort key, the value it destroys,
    and the occupancy it leaves."""

    key: tuple[object, ...]
    loss: int
    profile_id: int
    start: int
    after: Occupancy


class BucketOption(NamedTuple):
    """The best placement a (kind, occupancy, node busy) bucket offers one device; heap-ordered
    by ``rank``."""

    rank: tuple[object, ...]
    loss: int
    profile_id: int
    start: int
    members: list[tuple[str, str]]  # (node, uuid), sorted


class GpuOffer(NamedTuple):
    """One GPU a single-device decision tries, with the placement its bucket offers; ordered by
    (node, uuid) so that first fit can merge buckets."""

    node: str
    uuid: str
    profile_id: int
    start: int
    loss: int


@dataclass(frozen=True)
class FoundDevice:
    """One device of a solution: the slot it fills and where."""

    slot: Slot
    gpu: GpuRecord
    profile_id: int
    start: int


@dataclass(frozen=True)
class Found:
    """A solution before it is turned into API-shaped choices."""

    node: str
    devices: tuple[FoundDevice, ...]
    loss: int
