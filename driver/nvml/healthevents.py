"""GPU health as NVML reports it: XID and ECC events, the recovery action the driver asks
for, and the uncorrected-ECC counter.

Kept apart from the backend's MIG operations because the health monitor is its only user and
reads nothing else; the backend hands it device handles (reference: mig-and-nvml.md §14).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from driver.nvml import errors
from driver.nvml.calls import call, code_of

# nvml.h: event types, the recovery-action field, ECC counter selectors.
_EVENT_SINGLE_BIT_ECC = 0x1
_EVENT_DOUBLE_BIT_ECC = 0x2
_EVENT_XID = 0x8
_NO_INSTANCE = 0xFFFFFFFF  # nvmlEventData_t.gpuInstanceId of an event for the whole GPU
_HEALTH_EVENTS = _EVENT_SINGLE_BIT_ECC | _EVENT_DOUBLE_BIT_ECC | _EVENT_XID
_FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
_ECC_UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_ECC_VOLATILE = 0  # NVML_VOLATILE_ECC
_SUCCESS = 0
_TIMEOUT = 10  # NVML_ERROR_TIMEOUT


@dataclass(frozen=True)
class HealthEvent:
    """One NVML health event on a GPU: kind "xid" (with the XID), "ecc-corrected" or
    "ecc-uncorrected"; `gpu_instance` is the MIG GPU instance NVML attributes it to (None:
    the whole GPU)."""

    gpu_uuid: str
    kind: str
    xid: int | None = None
    gpu_instance: int | None = None


class HealthEvents:
    """An NVML event set subscribed to XID and ECC events of some GPUs (see `subscribe`);
    `wait` returns the next event or None after the timeout."""

    def __init__(
        self, nv: Any, event_set: Any, gpus: tuple[str, ...], uuid_of: Callable[[Any], str]
    ) -> None:
        self._nv = nv
        self._set = event_set
        self._uuid_of = uuid_of
        self.gpus = gpus  # the GPUs that deliver events; the others must be polled

    def wait(self, timeout_ms: int) -> HealthEvent | None:
        nv = self._nv
        try:
            data = nv.nvmlEventSetWait_v2(self._set, timeout_ms)
        except nv.NVMLError as exc:
            if code_of(nv, exc) == _TIMEOUT:
                return None
            raise errors.from_code(int(exc.value), "wait for GPU health events", gpu=None) from exc
        uuid = self._uuid_of(data.device)
        kind = int(data.eventType)
        if kind & _EVENT_XID:
            gi = int(data.gpuInstanceId)
            return HealthEvent(
                str(uuid), "xid", int(data.eventData), None if gi == _NO_INSTANCE else gi
            )
        if kind & _EVENT_DOUBLE_BIT_ECC:
            return HealthEvent(str(uuid), "ecc-uncorrected")
        return HealthEvent(str(uuid), "ecc-corrected")

    def close(self) -> None:
        nv = self._nv
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetFree(self._set)


def subscribe(
    nv: Any, handles: Mapping[str, Any], uuid_of: Callable[[Any], str]
) -> HealthEvents | None:
    """An event set for the XID and ECC events of those GPUs (UUID -> handle) that support
    them; None if none does: then health can only be polled (`recovery_action`)."""
    event_set = call(nv, "create an NVML event set", None, nv.nvmlEventSetCreate)
    registered = []
    for uuid, handle in handles.items():
        try:
            supported = int(nv.nvmlDeviceGetSupportedEventTypes(handle)) & _HEALTH_EVENTS
            if supported:
                nv.nvmlDeviceRegisterEvents(handle, supported, event_set)
                registered.append(uuid)
        except nv.NVMLError as exc:
            if code_of(nv, exc) != errors.NVML_ERROR_NOT_SUPPORTED:
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlEventSetFree(event_set)
                raise errors.from_code(
                    int(exc.value), "register GPU health events", gpu=uuid
                ) from exc
    if not registered:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetFree(event_set)
        return None
    return HealthEvents(nv, event_set, tuple(registered), uuid_of)


def recovery_action(nv: Any, gpu_uuid: str, handle: Any) -> int | None:
    """NVML_GPU_RECOVERY_ACTION_* the driver asks for now (0: none), or None where the GPU
    or driver does not report it."""
    values = call(
        nv,
        "read the GPU recovery action",
        gpu_uuid,
        nv.nvmlDeviceGetFieldValues,
        handle,
        [_FI_GPU_RECOVERY_ACTION],
    )
    value = values[0]
    if int(value.nvmlReturn) != _SUCCESS:
        return None
    return int(value.value.uiVal)


def uncorrected_ecc_errors(nv: Any, gpu_uuid: str, handle: Any) -> int | None:
    """Volatile uncorrected ECC errors (since the driver loaded or the GPU was reset), or
    None without ECC reporting."""
    try:
        return int(nv.nvmlDeviceGetTotalEccErrors(handle, _ECC_UNCORRECTED, _ECC_VOLATILE))
    except nv.NVMLError as exc:
        if code_of(nv, exc) == errors.NVML_ERROR_NOT_SUPPORTED:
            return None
        raise errors.from_code(int(exc.value), "read ECC errors", gpu=gpu_uuid) from exc
