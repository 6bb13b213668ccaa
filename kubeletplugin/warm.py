"""Warm slices: when to keep a released claim's MIG instance carved, and for whom.

Destroying a GPU instance takes about a second, and NVML changes on one GPU are serialised, so
a claim carved on a GPU right after another was released there waits behind that destroy. A
*warm* instance skips both: unprepare keeps the instance (no process may be left on it) and the
next claim allocated exactly that profile and placement takes it over instead of carving.

The controller never learns about warm instances: a released claim's placement is free to it,
as before. So a warm instance never blocks a placement; it only changes who pays for the
destroy. A claim allocated a placement that overlaps a warm instance it may not reuse (another
profile or placement, another namespace, or a whole GPU) reclaims the warm instance first, and
an instance nobody took within the TTL is reclaimed by housekeeping once its profile has
stopped coming to that GPU.

Per instance, the states (checkpointed, `WarmState`) and the only transitions:

    claim device (PREPARE_COMPLETED)  --park-->     IDLE           (one checkpoint save)
    IDLE                              --reuse-->    claim device   (one checkpoint save)
    IDLE                              --reclaim-->  RECLAIMING --destroyed--> (absent)
    IDLE                              --vanished--> (absent)       (found gone from NVML)

Each transfer between a claim and the warm pool is a single save, so the instance has exactly
one checkpointed owner at every instant (DESIGN invariant 2). RECLAIMING is never reused and a
restart finishes it, because a crash may have left the instance half destroyed.

This module is the pure part (decisions and transitions); kubeletplugin.prepare does the I/O.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from driver.catalog import Placement
from kubeletplugin.checkpoint import DeviceRecord, WarmInstance, WarmState


@dataclass(frozen=True)
class WarmSettings:
    """`ttl_s` 0 turns warm slices off. `across_namespaces` lets a claim of one namespace take
    over an instance another namespace's claim released (MIG isolates memory and caches between
    instances, not between successive users of one instance; carve clears nothing)."""

    ttl_s: float = 0.0
    across_namespaces: bool = False
    # At most this many warm instances per GPU (None: no limit). Each one another placement
    # needs costs that claim a ~1 s reclaim. Measured with 2 on the single-profile benchmark
    # it did more harm than good (every release beyond it is a destroy under the GPU lock, in
    # the way of the next carve), so there is no limit by default; see docs/benchmarks.md.
    max_per_gpu: int | None = None

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0


class WarmEvent(StrEnum):
    REUSE = "reuse"
    RECLAIM = "reclaim"
    DESTROYED = "destroyed"
    VANISHED = "vanished"


class WarmTransitionError(ValueError):
    """A transition the state machine does not have (a bug in the caller, never user input)."""


# (state, event) -> the next state; None: the instance leaves the warm pool.
_TRANSITIONS: dict[tuple[WarmState, WarmEvent], WarmState | None] = {
    (WarmState.IDLE, WarmEvent.REUSE): None,
    (WarmState.IDLE, WarmEvent.RECLAIM): WarmState.RECLAIMING,
    (WarmState.IDLE, WarmEvent.VANISHED): None,
    (WarmState.RECLAIMING, WarmEvent.DESTROYED): None,
    (WarmState.RECLAIMING, WarmEvent.VANISHED): None,
}


def transition(warm: WarmInstance, event: WarmEvent) -> WarmInstance | None:
    """The instance after `event`, or None once it is no longer warm."""
    key = (warm.state, event)
    if key not in _TRANSITIONS:
        raise WarmTransitionError(f"warm instance in state {warm.state.value}: no {event.value}")
    nxt = _TRANSITIONS[key]
    return None if nxt is None else replace(warm, state=nxt)


def park(device: DeviceRecord, namespace: str, now: float) -> WarmInstance:
    """The warm instance a released claim's carved device becomes."""
    if (
        device.gi_id is None
        or device.ci_id is None
        or device.mig_uuid is None
        or device.profile_id is None
        or device.placement_start is None
        or device.placement_size is None
    ):
        raise WarmTransitionError(f"device {device.device_name} has no complete MIG instance")
    return WarmInstance(
        gpu_uuid=device.gpu_uuid,
        gpu_minor=device.gpu_minor,
        gi_id=device.gi_id,
        ci_id=device.ci_id,
        mig_uuid=device.mig_uuid,
        profile_id=device.profile_id,
        placement_start=device.placement_start,
        placement_size=device.placement_size,
        namespace=namespace,
        since=now,
    )


def placement_of(warm: WarmInstance) -> Placement:
    return Placement(warm.placement_start, warm.placement_size)


def reusable_by(
    warm: WarmInstance,
    settings: WarmSettings,
    *,
    gpu_uuid: str,
    profile_id: int,
    placement: Placement,
    namespace: str,
) -> bool:
    """May a claim in `namespace`, allocated `profile_id` at `placement` on `gpu_uuid`, take
    this instance over? Only an idle one, exactly there, of that profile, in scope."""
    return (
        warm.state is WarmState.IDLE
        and warm.gpu_uuid == gpu_uuid
        and warm.profile_id == profile_id
        and placement_of(warm) == placement
        and (settings.across_namespaces or warm.namespace == namespace)
    )


def in_the_way(warm: WarmInstance, gpu_uuid: str, placement: Placement | None) -> bool:
    """Does the warm instance occupy memory slices of `placement` on `gpu_uuid` (None: the whole
    GPU, which needs every instance gone)?"""
    if warm.gpu_uuid != gpu_uuid:
        return False
    if placement is None:
        return True
    mine = placement_of(warm)
    return mine.start < placement.end and placement.start < mine.end


def expired(
    warm: WarmInstance, settings: WarmSettings, now: float, *, still_wanted: bool = False
) -> bool:
    """Idle past the TTL (or warm slices turned off since it was parked), unless its profile
    is `still_wanted` on the GPU: destroying it holds the GPU for a second, in the way of the
    very claims that keep coming there, while a warm instance blocks no placement."""
    if warm.state is not WarmState.IDLE or now - warm.since < settings.ttl_s:
        return False
    return not (settings.enabled and still_wanted)


def keep_verdict(
    settings: WarmSettings, *, processes: Iterable[int], predicted: bool, warm_on_gpu: int = 0
) -> tuple[bool, str]:
    """Keep a released instance warm, and why (or why not), for the log."""
    if not settings.enabled:
        return False, "warm slices are off"
    if settings.max_per_gpu is not None and warm_on_gpu >= settings.max_per_gpu:
        return False, f"the GPU already has {warm_on_gpu} warm instance(s), the most it keeps"
    pids = sorted(processes)
    if pids:
        return False, f"processes still run on it (pids {', '.join(map(str, pids))})"
    if not predicted:
        return False, "no other claim of this profile was prepared on this GPU recently"
    return True, "another claim of this profile on this GPU is likely soon"


class Demand:
    """Recent prepares per (GPU, profile): the prediction that another claim of the profile
    will come to this GPU. A profile prepared on a GPU at least twice within the TTL (the
    releasing claim's own prepare and one more) is predicted to come again."""

    def __init__(self, window_s: float, keep: int = 8) -> None:
        self._window = window_s
        self._keep = keep
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], deque[float]] = {}

    def record(self, gpu_uuid: str, profile_id: int, now: float) -> None:
        with self._lock:
            q = self._seen.setdefault((gpu_uuid, profile_id), deque(maxlen=self._keep))
            q.append(now)

    def predicted(self, gpu_uuid: str, profile_id: int, now: float) -> bool:
        with self._lock:
            q = self._seen.get((gpu_uuid, profile_id), ())
            return sum(1 for t in q if now - t <= self._window) >= 2
