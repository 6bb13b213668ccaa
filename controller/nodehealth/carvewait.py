"""Hold a pod's scheduling gate until its node has carved (carve before bind, fast path).

With binding conditions on the devices (the plugin's `--binding-conditions`), kube-scheduler
waits in PreBind until the claim's `status.devices` says `<driver>/Carved`, but it checks
once and then only every 5 seconds (v1.37 `dynamicresources.go`, PreBind), while a carve takes
well under a second. So the controller keeps carve's scheduling gate on the pod after writing
the allocation and removes it when every device that asks for binding conditions reports them
True: kube-scheduler's first check then passes and it binds at once. The binding conditions
still guard the bind; holding the gate only saves the poll interval.

A device that reports a binding failure condition (`<driver>/CarveFailed`) makes the
controller clear the allocation itself (the pod is still gated, so kube-scheduler never saw
it) and place the claim again; the node has already torn the failed carve down and tainted the
GPU if NVML refused. A node that reports nothing within the wait (`--carve-wait`) does not keep
the pod gated forever: the gate is removed and kube-scheduler's own wait (and its timeout)
takes over.

The decision is pure (`carve_verdict`); `controller.nodehealth.carvehold` acts on it.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocation import AllocatedDevice, AllocationFormatError, parse_allocation
from driver.apiviews import ClaimView
from process.kube import Obj


class CarveState(enum.Enum):
    NONE = "none"  # no device asks for binding conditions: ungate as always
    PENDING = "pending"  # some device has no verdict yet: keep the gate
    READY = "ready"  # every binding condition is True: ungate, kube-scheduler binds at once
    TIMED_OUT = "timed-out"  # no verdict within the wait: ungate, kube-scheduler waits
    FAILED = "failed"  # a binding failure condition is True: clear and place again


@dataclass(frozen=True)
class CarveFailure:
    claim: str  # namespace/name
    device: str  # pool/device
    message: str


@dataclass(frozen=True)
class CarveVerdict:
    state: CarveState
    failures: tuple[CarveFailure, ...] = ()
    waiting_for: tuple[str, ...] = ()  # pool/device without a verdict yet
    wait_left: float = 0.0  # seconds until TIMED_OUT, while PENDING


def plan_waits_for_carve(results: Sequence[AllocatedDevice]) -> bool:
    """Whether a freshly written allocation must keep the gate (some result asks)."""
    return any(r.binding_conditions for r in results)


def carve_verdict(
    claims: Sequence[Obj], driver: str, now: dt.datetime, wait: float
) -> CarveVerdict:
    """What the node has reported for the devices of `claims` (allocated carve claims)."""
    failures: list[CarveFailure] = []
    waiting: list[str] = []
    oldest: dt.datetime | None = None
    asked = False
    for claim in claims:
        view = ClaimView(claim)
        try:
            results = parse_allocation(view.status.get("allocation")).results_for(driver)
        except AllocationFormatError:
            continue  # not what carve writes: nothing to wait for
        conditions = _device_conditions(view.device_statuses)
        ckey = f"{view.namespace}/{view.name}"
        for r in results:
            if not r.binding_conditions:
                continue
            asked = True
            have = conditions.get((r.driver, r.pool, r.device, r.share_id), {})
            failed = [c for c in r.binding_failure_conditions if have.get(c, ("", ""))[0] == "True"]
            if failed:
                failures.append(CarveFailure(ckey, f"{r.pool}/{r.device}", have[failed[0]][1]))
            elif not all(have.get(c, ("", ""))[0] == "True" for c in r.binding_conditions):
                waiting.append(f"{r.pool}/{r.device}")
                stamp = _timestamp(view.allocation.get("allocationTimestamp"))
                if stamp is not None and (oldest is None or stamp < oldest):
                    oldest = stamp
    if not asked:
        return CarveVerdict(CarveState.NONE)
    if failures:
        return CarveVerdict(CarveState.FAILED, tuple(failures))
    if not waiting:
        return CarveVerdict(CarveState.READY)
    left = wait if oldest is None else wait - (now - oldest).total_seconds()
    if left <= 0:
        return CarveVerdict(CarveState.TIMED_OUT, waiting_for=tuple(waiting))
    return CarveVerdict(CarveState.PENDING, waiting_for=tuple(waiting), wait_left=left)


def _device_conditions(
    devices: Sequence[Mapping[str, Any]],
) -> Mapping[tuple[str, str, str, str | None], Mapping[str, tuple[str, str]]]:
    """(driver, pool, device, shareID) -> condition type -> (status, message)."""
    out: dict[tuple[str, str, str, str | None], dict[str, tuple[str, str]]] = {}
    for entry in devices:
        key = (
            str(entry.get("driver")),
            str(entry.get("pool")),
            str(entry.get("device")),
            entry.get("shareID"),
        )
        for cond in entry.get("conditions") or ():
            if isinstance(cond, Mapping) and isinstance(cond.get("type"), str):
                out.setdefault(key, {})[cond["type"]] = (
                    str(cond.get("status", "")),
                    str(cond.get("message", "")),
                )
    return out


def _timestamp(value: object) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        stamp = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)
