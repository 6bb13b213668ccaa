"""What a caller hands the engine and what it gets back.

These are the only engine types other packages need: the planner builds a
:class:`PlacementRequest`, the engine answers a :class:`Placement` (one :class:`DeviceChoice` per
allocated device, all on one node) or a :class:`NoPlacement` whose message is written to be
shown as it is, in an event or a condition. All are frozen so a decision can be compared,
logged and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from controller.claims import ClaimHold, ClaimKey, ClaimSpec
from controller.nodefit import PodNeeds
from driver.allocation import AllocatedDevice

MAX_COMBINATIONS = 64
"""firstAvailable combinations tried per decision (8 alternatives on 32 requests would be
8**32); the first ones are the preferred ones."""
MAX_DEVICES_PER_POD = 128
"""Bounds the search depth; no node publishes anywhere near this many usable slices."""
MAX_RESULTS_PER_CLAIM = 32
"""status.allocation.devices.results limit."""


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
        return tuple(
            ClaimHold(k, self.node, tuple(sorted(v, key=AllocatedDevice.sort_key)))
            for k, v in sorted(by_claim.items())
        )


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
