"""The C shapes of the simulated API: handle pointers and ctypes out-parameters.

Handles are genuine ``c_nvmlDevice_t`` / ``c_nvmlGpuInstance_t`` / ``c_nvmlComputeInstance_t``
pointers whose address encodes what they name (kind, GPU, GI id, CI id, and the serial of the
instance when the handle was made). Nothing is kept per handle, so handles cross processes and
restarts like NVML's do, and a handle to an instance that was destroyed (or destroyed and
re-created) no longer matches the state and gives ``NVML_ERROR_INVALID_ARGUMENT``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from driver.catalog import GpuModel
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.hardware import CiRec, GiRec, GpuRec, HwState
from driver.nvml.sim.runtime import raise_nvml

KIND_DEVICE, KIND_GI, KIND_CI, KIND_MIG = 1, 2, 3, 4


def _handle(
    ptr_type: Any, kind: int, gpu: int, *, gi: int = 0, ci: int = 0, serial: int = 0
) -> Any:
    addr = (kind << 56) | (gpu << 48) | (gi << 40) | (ci << 32) | (serial & 0xFFFFFFFF)
    return ctypes.cast(ctypes.c_void_p(addr), ptr_type)


def decode(handle: Any) -> tuple[int, int, int, int, int]:
    """(kind, GPU index, GI id, CI id, serial) of a handle; INVALID_ARGUMENT for NULL or junk."""
    try:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        addr = None
    if not addr:
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert addr is not None
    return (
        addr >> 56,
        (addr >> 48) & 0xFF,
        (addr >> 40) & 0xFF,
        (addr >> 32) & 0xFF,
        addr & 0xFFFFFFFF,
    )


def device_handle(index: int) -> Any:
    return _handle(pynvml.c_nvmlDevice_t, KIND_DEVICE, index)


def gi_handle(index: int, gi: GiRec) -> Any:
    return _handle(pynvml.c_nvmlGpuInstance_t, KIND_GI, index, gi=gi.id, serial=gi.serial)


def ci_handle(index: int, gi: GiRec, ci: CiRec) -> Any:
    return _handle(
        pynvml.c_nvmlComputeInstance_t, KIND_CI, index, gi=gi.id, ci=ci.id, serial=ci.serial
    )


def mig_handle(index: int, gi: GiRec, ci: CiRec) -> Any:
    return _handle(pynvml.c_nvmlDevice_t, KIND_MIG, index, gi=gi.id, ci=ci.id, serial=ci.serial)


def gpu_index_of(cfg: SimConfig, handle: Any, kinds: tuple[int, ...]) -> int:
    """The GPU index a handle names, for calls that need no state (so take no lock)."""
    kind, gpu, *_ = decode(handle)
    if kind not in kinds or gpu >= len(cfg.gpus):
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return gpu


class Resolved:
    """What a handle names in the current state (stale handles never get this far)."""

    def __init__(self, index: int, model: GpuModel, gpu: GpuRec) -> None:
        self.index = index
        self.model = model
        self.gpu = gpu
        self.gi: GiRec | None = None
        self.ci: CiRec | None = None


def resolve(cfg: SimConfig, state: HwState, handle: Any, kinds: tuple[int, ...]) -> Resolved:
    """The GPU, GI and CI ``handle`` names, or INVALID_ARGUMENT if it is of another kind or
    names an instance that no longer exists (the serial differs)."""
    kind, index, gi_id, ci_id, serial = decode(handle)
    if kind not in kinds or index >= len(cfg.gpus):
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    r = Resolved(index, cfg.gpus[index].model, state.gpus[index])
    if r.gpu.lost:
        raise_nvml(pynvml.NVML_ERROR_GPU_IS_LOST)
    if kind == KIND_GI:
        r.gi = r.gpu.gi(gi_id)
        if r.gi is None or r.gi.serial != serial:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    elif kind in (KIND_CI, KIND_MIG):
        r.gi = r.gpu.gi(gi_id)
        r.ci = None if r.gi is None else next((c for c in r.gi.cis if c.id == ci_id), None)
        if r.ci is None or r.ci.serial != serial:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return r


# --- ctypes arguments ----------------------------------------------------------------------------


def target(ref: Any) -> Any:
    """The object a byref()/pointer()/plain ctypes argument refers to."""
    obj = getattr(ref, "_obj", None)  # ctypes.byref(...) result
    if obj is not None:
        return obj
    return ref


def _read_count(count_ref: Any) -> Any:
    found = target(count_ref)
    if isinstance(found, ctypes._Pointer):
        found = found.contents
    if not hasattr(found, "value"):
        raise TypeError("count must be a ctypes.c_uint passed with ctypes.byref()")
    return found


def fill_array(items: list[Any], array_ref: Any, count_ref: Any) -> None:
    """NVML's two-call protocol: NULL array -> report the count; too small -> INSUFFICIENT_SIZE."""
    count = _read_count(count_ref)
    if array_ref is None:
        count.value = len(items)
        return
    array = target(array_ref)
    capacity = len(array) if isinstance(array, ctypes.Array) else int(count.value)
    if capacity < len(items):
        count.value = len(items)
        raise_nvml(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, item in enumerate(items):
        array[i] = item
    count.value = len(items)
