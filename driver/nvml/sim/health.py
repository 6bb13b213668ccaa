"""Simulated NVML health: XID and ECC events, ECC counters and the GPU recovery action.

The event API has pynvml's shapes: ``nvmlEventSetCreate`` gives a ``c_nvmlEventSet_t``,
``nvmlDeviceRegisterEvents(device, mask, set)`` subscribes it, ``nvmlEventSetWait_v2(set, ms)``
returns a ``c_nvmlEventData_t`` (``device``, ``eventType``, ``eventData`` = the XID) or raises
``NVML_ERROR_TIMEOUT``. As in NVML an event set is local to its process and sees only events
that happen after it registered; the events themselves live in the state file, so a test (or
``sim_inject_xid`` from another process) raises them where the plugin waits.

What the driver does on an XID is the simulator's part, not the plugin's: XIDs whose documented
resolution is a GPU reset (NVIDIA's XID catalog: 48 double-bit ECC, 62 and 140 unrecovered
errors, 64 row-remapping failure, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC, 119 and
120 GSP) set the recovery action field (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) to GPU_RESET
until ``sim_reset_gpu``; a double-bit ECC error also counts as an uncorrected volatile error.
With ``options.health_events: false`` the GPUs support no events (as under some hypervisors)
and only the counters and the field can be read, so a monitor has to poll.
"""

# ruff: noqa: N802, N816 -- names mirror pynvml exactly.
from __future__ import annotations

import ctypes
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml

from driver.nvml.sim.calls import call
from driver.nvml.sim.config import SimConfig, SimConfigError
from driver.nvml.sim.handles import KIND_DEVICE, decode, device_handle, resolve
from driver.nvml.sim.hardware import HwState
from driver.nvml.sim.runtime import admin, raise_nvml, require_init, state_store

XID_NEEDS_RESET = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
XID_GPU_LOST = 79  # "GPU has fallen off the bus"
SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeXidCriticalError
)
_KEPT_EVENTS = 256  # the state keeps the newest events only; a waiter far behind misses some
_POLL_SECONDS = 0.05


@dataclass
class _EventSet:
    after: int  # serial of the newest event when the set was created
    masks: dict[int, int] = field(default_factory=dict)  # GPU index -> event types


_sets: dict[int, _EventSet] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def _set_of(event_set: Any) -> _EventSet:
    try:
        key = ctypes.cast(event_set, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        key = None
    found = _sets.get(key or 0)
    if found is None:
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert found is not None
    return found


def nvmlEventSetCreate() -> Any:
    serial = call("EventSetCreate", None, lambda cfg, state: state.event_serial)
    with _lock:
        key = next(_ids)
        _sets[key] = _EventSet(after=serial)
    return ctypes.cast(ctypes.c_void_p(key), pynvml.c_nvmlEventSet_t)


def nvmlEventSetFree(event_set: Any) -> None:
    require_init()
    with _lock:
        _set_of(event_set)
        _sets.pop(ctypes.cast(event_set, ctypes.c_void_p).value or 0, None)


def nvmlDeviceGetSupportedEventTypes(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        resolve(cfg, state, device, (KIND_DEVICE,))
        return SUPPORTED_EVENTS if cfg.health_events else 0

    return call("DeviceGetSupportedEventTypes", device, body)


def nvmlDeviceRegisterEvents(device: Any, event_types: int, event_set: Any) -> None:
    def body(cfg: SimConfig, state: HwState) -> None:
        resolve(cfg, state, device, (KIND_DEVICE,))
        if not cfg.health_events or int(event_types) & ~SUPPORTED_EVENTS:
            raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)

    call("DeviceRegisterEvents", device, body)
    index = decode(device)[1]
    with _lock:
        s = _set_of(event_set)
        s.masks[index] = s.masks.get(index, 0) | int(event_types)


def nvmlEventSetWait_v2(event_set: Any, timeoutms: int) -> Any:
    """The next event for the set, or NVML_ERROR_TIMEOUT after ``timeoutms``."""
    cfg = require_init()
    store = state_store(cfg)
    deadline = time.monotonic() + max(0, int(timeoutms)) / 1000
    while True:
        with _lock:
            s = _set_of(event_set)
            after, masks = s.after, dict(s.masks)
        with store.transaction() as state:
            events = [dict(e) for e in state.events]
            newest = state.event_serial
        for e in events:
            if e["serial"] > after and masks.get(e["gpu"], 0) & e["type"]:
                with _lock:
                    s.after = e["serial"]
                data = pynvml.c_nvmlEventData_t()
                data.device = device_handle(e["gpu"])
                data.eventType = e["type"]
                data.eventData = e["data"]
                # As NVML: the GPU instance the event is attributable to (MIG), else all ones.
                data.gpuInstanceId = e.get("gi", _NO_INSTANCE)
                data.computeInstanceId = _NO_INSTANCE
                return data
        with _lock:
            s.after = max(s.after, newest)
        if time.monotonic() >= deadline:
            raise_nvml(pynvml.NVML_ERROR_TIMEOUT)
        time.sleep(_POLL_SECONDS)


nvmlEventSetWait = nvmlEventSetWait_v2


def nvmlDeviceGetTotalEccErrors(device: Any, error_type: int, counter_type: int) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        if counter_type not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return r.gpu.ecc_uncorrected
        if error_type != pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return r.gpu.ecc_corrected

    return call("DeviceGetTotalEccErrors", device, body)


def nvmlDeviceGetFieldValues(device: Any, field_ids: list[int]) -> Any:
    """Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION has a value; other fields come back with
    nvmlReturn NOT_SUPPORTED in their slot, as NVML reports a field a GPU lacks."""

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            values[i].timestamp = int(time.time() * 1e6)
            if fid == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = r.gpu.recovery_action
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    return call("DeviceGetFieldValues", device, body)


# --- injection (sim-only) -------------------------------------------------------------------


_NO_INSTANCE = 0xFFFFFFFF  # NVML's value for an event not attributable to one instance


def _raise_event(
    state: HwState, gpu: int, event_type: int, data: int, gi: int = _NO_INSTANCE
) -> None:
    state.event_serial += 1
    event = {"serial": state.event_serial, "gpu": gpu, "type": event_type, "data": data}
    if gi != _NO_INSTANCE:
        event["gi"] = gi
    state.events.append(event)
    del state.events[:-_KEPT_EVENTS]


def _gpu_index(state: HwState, gpu: int) -> int:
    if not 0 <= gpu < len(state.gpus):
        raise SimConfigError(f"no GPU {gpu}: the node has {len(state.gpus)}")
    return gpu


def sim_inject_xid(
    gpu: int, xid: int, *, recovery_action: int | None = None, gpu_instance: int | None = None
) -> None:
    """The driver reports XID ``xid`` on GPU ``gpu`` (index): an XID critical-error event, and
    the recovery action it asks for (by default GPU_RESET for XIDs that need one, else none;
    an action already pending is never lowered). With ``gpu_instance`` (a GI id that exists)
    the event is attributable to that MIG instance, as NVML says in ``gpuInstanceId``."""
    if xid <= 0:
        raise SimConfigError(f"an XID is a positive number, not {xid}")

    def body(cfg: SimConfig, state: HwState) -> None:
        index = _gpu_index(state, gpu)
        if gpu_instance is not None and all(g.id != gpu_instance for g in state.gpus[index].gis):
            have = sorted(g.id for g in state.gpus[index].gis)
            raise SimConfigError(
                f"GPU {gpu} has no GPU instance {gpu_instance} (it has {have or 'none'})"
            )
        action = recovery_action
        if action is None:
            action = (
                pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
                if xid in XID_NEEDS_RESET
                else pynvml.NVML_GPU_RECOVERY_ACTION_NONE
            )
        rec = state.gpus[index]
        rec.recovery_action = max(rec.recovery_action, action)
        if xid == XID_GPU_LOST:
            rec.lost = True  # every later call on it answers GPU_IS_LOST, until a reset
        if xid == 48:
            rec.ecc_uncorrected += 1
        gi = _NO_INSTANCE if gpu_instance is None else gpu_instance
        _raise_event(state, index, pynvml.nvmlEventTypeXidCriticalError, xid, gi)

    admin(body)


def sim_inject_ecc(gpu: int, *, uncorrected: bool) -> None:
    """One ECC error on GPU ``gpu``: a single-bit (corrected) or double-bit (uncorrected) ECC
    event and its volatile counter; an uncorrected one also asks for a GPU reset."""

    def body(cfg: SimConfig, state: HwState) -> None:
        index = _gpu_index(state, gpu)
        rec = state.gpus[index]
        if uncorrected:
            rec.ecc_uncorrected += 1
            rec.recovery_action = max(
                rec.recovery_action, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
            )
            _raise_event(state, index, pynvml.nvmlEventTypeDoubleBitEccError, 0)
        else:
            rec.ecc_corrected += 1
            _raise_event(state, index, pynvml.nvmlEventTypeSingleBitEccError, 0)

    admin(body)


def sim_health(gpu: int) -> dict[str, int]:
    """The GPU's recovery action and volatile ECC counts, for tests."""

    def body(cfg: SimConfig, state: HwState) -> dict[str, int]:
        rec = state.gpus[_gpu_index(state, gpu)]
        return {
            "recovery_action": rec.recovery_action,
            "ecc_corrected": rec.ecc_corrected,
            "ecc_uncorrected": rec.ecc_uncorrected,
        }

    return admin(body)
