"""A drop-in stand-in for the ``pynvml`` module that simulates MIG-capable GPUs.

``import driver.nvml.sim as nvml`` gives the same function names and argument shapes as
``pynvml`` (nvidia-ml-py) for everything carve's backend calls, returns pynvml's own ctypes
structs and handle types, and raises ``pynvml.NVMLError`` subclasses with the real codes, so
the backend cannot tell it from NVML. Handles are genuine ``c_nvmlDevice_t`` /
``c_nvmlGpuInstance_t`` / ``c_nvmlComputeInstance_t`` pointers whose address encodes what they
name; a handle to an instance that was destroyed (or destroyed and re-created) is stale and
gives ``NVML_ERROR_INVALID_ARGUMENT``.

The hardware state lives in a locked file (see ``hardware``), so it survives process restarts
and is shared by every process on the node that uses the same configuration.

Functions whose names start with ``sim_`` (and ``configure``) are simulator administration:
reset or reboot a GPU, inject faults, inspect state. NVML has nothing like them and the
product never calls them.
"""

# ruff: noqa: N802, N803, N816 -- names and parameters mirror pynvml exactly; that is the point.
from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pynvml
import yaml

from driver.catalog import Architecture, GpuModel, Placement, ProfileSpec
from driver.nvml.sim import config as _cfgmod
from driver.nvml.sim.config import (
    ENV_CONFIG,
    ENV_FAULT_TAG,
    Fault,
    SimConfig,
    SimConfigError,
    load_config_file,
    parse_config,
)
from driver.nvml.sim.hardware import (
    CI_SIZE_FOR_INDEX,
    MAX_CIS_PER_GI,
    CiRec,
    GiRec,
    GpuRec,
    HwState,
    StateStore,
    auto_placement_order,
    ci_free_start,
    ci_sizes,
    gi_fit_error,
    gi_id_for,
    mig_uuid,
    remaining_capacity,
    validate_model,
)

# Re-export pynvml's constants, error classes and ctypes structs so that code written against
# pynvml finds them here under the same names (NVML_*, NVMLError*, c_nvml*, nvml*_t, versions).
_EXPORT_PREFIXES = ("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo", "nvmlMemory", "struct_c_nvml")
globals().update(
    {k: v for k, v in vars(pynvml).items() if k.startswith(_EXPORT_PREFIXES) and k not in globals()}
)
NVMLError = pynvml.NVMLError
nvmlGpuInstanceProfileInfo_v2 = pynvml.nvmlGpuInstanceProfileInfo_v2
nvmlComputeInstanceProfileInfo_v2 = pynvml.nvmlComputeInstanceProfileInfo_v2
nvmlExceptionClass = pynvml.nvmlExceptionClass

__all__ = [
    "NVMLError",
    "configure",
    "sim_clear_faults",
    "sim_config",
    "sim_crash_at",
    "sim_inject_fault",
    "sim_proc_root",
    "sim_reboot",
    "sim_reset_gpu",
    "sim_set_busy",
    "sim_snapshot",
    "sim_write_config",
]

_T = TypeVar("_T")
_MIB = 1024 * 1024

_ARCH_CODE = {
    Architecture.AMPERE: pynvml.NVML_DEVICE_ARCH_AMPERE,
    Architecture.HOPPER: pynvml.NVML_DEVICE_ARCH_HOPPER,
    Architecture.BLACKWELL: pynvml.NVML_DEVICE_ARCH_BLACKWELL,
}

# --- configuration and process-local runtime ---------------------------------------------------


class _Runtime:
    """Process-local simulator state: the chosen config and nvmlInit's reference count."""

    explicit: SimConfig | None = None
    env_cache: tuple[str, float, SimConfig] | None = None
    store: tuple[SimConfig, StateStore] | None = None
    init_count = 0


def _store(cfg: SimConfig) -> StateStore:
    if _rt.store is None or _rt.store[0] is not cfg:
        _rt.store = (cfg, StateStore(cfg))
    return _rt.store[1]


_rt = _Runtime()


def configure(
    source: SimConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
) -> SimConfig | None:
    """Select the simulated node for this process (sim-only).

    ``source`` is a SimConfig, a mapping in the config-file schema (relative paths resolve
    against ``base_dir``, default the current directory), or the path of a config file.
    ``None`` goes back to the file named by CARVE_SIM_CONFIG. Returns the active config.
    """
    if source is None:
        _rt.explicit = None
        return _config_or_none()
    if isinstance(source, SimConfig):
        cfg = source
    elif isinstance(source, Mapping):
        cfg = parse_config(source, Path(base_dir) if base_dir else Path.cwd())
    else:
        cfg = load_config_file(source)
    _rt.explicit = _validated(cfg)
    return cfg


def _validated(cfg: SimConfig) -> SimConfig:
    """``cfg`` once every GPU model in it is one the simulator can represent."""
    for gpu in cfg.gpus:
        validate_model(gpu.model)
    return cfg


def _config_or_none() -> SimConfig | None:
    if _rt.explicit is not None:
        return _rt.explicit
    path = os.environ.get(ENV_CONFIG)
    if not path:
        return None
    mtime = Path(path).stat().st_mtime if Path(path).exists() else -1.0
    if _rt.env_cache is None or _rt.env_cache[:2] != (path, mtime):
        _rt.env_cache = (path, mtime, _validated(load_config_file(path)))
    return _rt.env_cache[2]


def sim_config() -> SimConfig:
    """The active simulator configuration (sim-only); raises SimConfigError if there is none."""
    cfg = _config_or_none()
    if cfg is None:
        raise SimConfigError(
            f"no simulator configured: set {ENV_CONFIG} to a config file or call configure()"
        )
    return cfg


def _raise(code: int) -> Any:
    raise pynvml.NVMLError(code)


def _require_init() -> SimConfig:
    if _rt.init_count <= 0:
        _raise(pynvml.NVML_ERROR_UNINITIALIZED)
    return sim_config()


# --- handles ------------------------------------------------------------------------------------

_KIND_DEVICE, _KIND_GI, _KIND_CI, _KIND_MIG = 1, 2, 3, 4


def _handle(
    ptr_type: Any, kind: int, gpu: int, *, gi: int = 0, ci: int = 0, serial: int = 0
) -> Any:
    addr = (kind << 56) | (gpu << 48) | (gi << 40) | (ci << 32) | (serial & 0xFFFFFFFF)
    return ctypes.cast(ctypes.c_void_p(addr), ptr_type)


def _decode(handle: Any) -> tuple[int, int, int, int, int]:
    try:
        addr = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        addr = None
    if not addr:
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert addr is not None
    return (
        addr >> 56,
        (addr >> 48) & 0xFF,
        (addr >> 40) & 0xFF,
        (addr >> 32) & 0xFF,
        addr & 0xFFFFFFFF,
    )


def _device_handle(index: int) -> Any:
    return _handle(pynvml.c_nvmlDevice_t, _KIND_DEVICE, index)


def _gi_handle(index: int, gi: GiRec) -> Any:
    return _handle(pynvml.c_nvmlGpuInstance_t, _KIND_GI, index, gi=gi.id, serial=gi.serial)


def _ci_handle(index: int, gi: GiRec, ci: CiRec) -> Any:
    return _handle(
        pynvml.c_nvmlComputeInstance_t, _KIND_CI, index, gi=gi.id, ci=ci.id, serial=ci.serial
    )


def _mig_handle(index: int, gi: GiRec, ci: CiRec) -> Any:
    return _handle(pynvml.c_nvmlDevice_t, _KIND_MIG, index, gi=gi.id, ci=ci.id, serial=ci.serial)


def _gpu_index_of(cfg: SimConfig, handle: Any, kinds: tuple[int, ...]) -> int:
    kind, gpu, *_ = _decode(handle)
    if kind not in kinds or gpu >= len(cfg.gpus):
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return gpu


class _Resolved:
    """What a handle names in the current state (stale handles never get this far)."""

    def __init__(self, index: int, model: GpuModel, gpu: GpuRec) -> None:
        self.index = index
        self.model = model
        self.gpu = gpu
        self.gi: GiRec | None = None
        self.ci: CiRec | None = None


def _resolve(cfg: SimConfig, state: HwState, handle: Any, kinds: tuple[int, ...]) -> _Resolved:
    kind, index, gi_id, ci_id, serial = _decode(handle)
    if kind not in kinds or index >= len(cfg.gpus):
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    r = _Resolved(index, cfg.gpus[index].model, state.gpus[index])
    if kind == _KIND_GI:
        r.gi = r.gpu.gi(gi_id)
        if r.gi is None or r.gi.serial != serial:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    elif kind in (_KIND_CI, _KIND_MIG):
        r.gi = r.gpu.gi(gi_id)
        r.ci = None if r.gi is None else next((c for c in r.gi.cis if c.id == ci_id), None)
        if r.ci is None or r.ci.serial != serial:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return r


# --- the per-call transaction: latency, faults, lock ---------------------------------------------


def _latency(cfg: SimConfig, op: str, index: int | None) -> float:
    if index is not None and index < len(cfg.gpus):
        arch = cfg.gpus[index].model.architecture.value
        if f"{op}.{arch}" in cfg.latency:
            return cfg.latency[f"{op}.{arch}"]
    return cfg.latency.get(op, 0.0)


def _fire(store: StateStore, state: HwState, op: str, gpu: int | None, when: str) -> None:
    tag = os.environ.get(ENV_FAULT_TAG)
    for raw in state.faults:
        fault = Fault(**{k: v for k, v in raw.items() if k != "remaining"})
        if raw["remaining"] <= 0 or fault.when != when or not fault.matches(op, gpu, tag):
            continue
        raw["remaining"] -= 1
        state.faults = [f for f in state.faults if f["remaining"] > 0]
        store.save_now(state)  # consume the fault durably before acting on it
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover -- SIGKILL is not deliverable late
        _raise(fault.code)


def _call(op: str, handle: Any, body: Callable[[SimConfig, HwState], _T]) -> _T:
    cfg = _require_init()
    index: int | None = None
    if handle is not None:
        index = _decode(handle)[1]
    delay = _latency(cfg, op, index)
    if delay > 0:
        time.sleep(delay)
    store = _store(cfg)
    with store.transaction() as state:
        _fire(store, state, op, index, "before")
        result = body(cfg, state)
        _fire(store, state, op, index, "after")
    return result


def _require_privilege(cfg: SimConfig) -> None:
    if not cfg.privileged:
        _raise(pynvml.NVML_ERROR_NO_PERMISSION)


def _require_mig_capable(r: _Resolved) -> None:
    if not r.gpu.mig_capable:
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _require_mig_enabled(r: _Resolved) -> None:
    _require_mig_capable(r)
    if r.gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _profile_by_id(r: _Resolved, profile_id: int) -> ProfileSpec:
    prof = next((p for p in r.model.profiles if p.id == profile_id), None)
    if prof is None:
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert prof is not None
    return prof


# --- ctypes argument helpers ---------------------------------------------------------------------


def _target(ref: Any) -> Any:
    """The object a byref()/pointer()/plain ctypes argument refers to."""
    obj = getattr(ref, "_obj", None)  # ctypes.byref(...) result
    if obj is not None:
        return obj
    return ref


def _read_count(count_ref: Any) -> Any:
    target = _target(count_ref)
    if isinstance(target, ctypes._Pointer):
        target = target.contents
    if not hasattr(target, "value"):
        raise TypeError("count must be a ctypes.c_uint passed with ctypes.byref()")
    return target


def _fill_array(items: list[Any], array_ref: Any, count_ref: Any) -> None:
    """NVML's two-call protocol: NULL array -> report the count; too small -> INSUFFICIENT_SIZE."""
    count = _read_count(count_ref)
    if array_ref is None:
        count.value = len(items)
        return
    array = _target(array_ref)
    capacity = len(array) if isinstance(array, ctypes.Array) else int(count.value)
    if capacity < len(items):
        count.value = len(items)
        _raise(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    for i, item in enumerate(items):
        array[i] = item
    count.value = len(items)


# --- library and system --------------------------------------------------------------------------


def nvmlInitWithFlags(flags: int) -> None:
    if _config_or_none() is None:
        _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    _rt.init_count += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    if _rt.init_count <= 0:
        _raise(pynvml.NVML_ERROR_UNINITIALIZED)
    _rt.init_count -= 1


def nvmlSystemGetDriverVersion() -> str:
    return _require_init().driver_version


def nvmlSystemGetCudaDriverVersion() -> int:
    return _require_init().cuda_driver_version


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlDeviceGetCount() -> int:
    return len(_require_init().gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    cfg = _require_init()
    if not 0 <= int(index) < len(cfg.gpus):
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return _device_handle(int(index))


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> Any:
    wanted = uuid.decode() if isinstance(uuid, bytes) else uuid

    def body(cfg: SimConfig, state: HwState) -> Any:
        for i, gpu in enumerate(state.gpus):
            if gpu.uuid == wanted:
                return _device_handle(i)
            for gi in gpu.gis:
                for ci in gi.cis:
                    if ci.uuid == wanted:
                        return _mig_handle(i, gi, ci)
        return _raise(pynvml.NVML_ERROR_NOT_FOUND)

    return _call("DeviceGetHandleByUUID", None, body)


def nvmlDeviceGetIndex(handle: Any) -> int:
    return _gpu_index_of(_require_init(), handle, (_KIND_DEVICE,))


def nvmlDeviceGetUUID(handle: Any) -> str:
    def body(cfg: SimConfig, state: HwState) -> str:
        r = _resolve(cfg, state, handle, (_KIND_DEVICE, _KIND_MIG))
        return r.ci.uuid if r.ci is not None else r.gpu.uuid

    return _call("DeviceGetUUID", handle, body)


def nvmlDeviceGetName(handle: Any) -> str:
    def body(cfg: SimConfig, state: HwState) -> str:
        r = _resolve(cfg, state, handle, (_KIND_DEVICE, _KIND_MIG))
        if r.gi is None:
            return r.model.product_name
        return f"{r.model.product_name} MIG {_profile_by_id(r, r.gi.profile_id).name}"

    return _call("DeviceGetName", handle, body)


def nvmlDeviceGetMinorNumber(handle: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, handle, (_KIND_DEVICE, _KIND_MIG))
        if r.gi is not None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return r.gpu.minor

    return _call("DeviceGetMinorNumber", handle, body)


def nvmlDeviceGetPciInfo_v3(handle: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, handle, (_KIND_DEVICE, _KIND_MIG))
        info = pynvml.nvmlPciInfo_t()
        bus_id = r.gpu.bus_id.encode()
        info.busId = bus_id
        info.busIdLegacy = bus_id[-12:] if len(bus_id) > 15 else bus_id
        info.domain = 0
        info.bus = int(r.gpu.bus_id.split(":")[1], 16)
        info.device = 0
        info.pciDeviceId = (r.model.pci_device_ids[0] << 16) | 0x10DE
        info.pciSubSystemId = 0x10DE0000 | r.model.pci_device_ids[0]
        return info

    return _call("DeviceGetPciInfo", handle, body)


nvmlDeviceGetPciInfo = nvmlDeviceGetPciInfo_v3


def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, handle, (_KIND_DEVICE, _KIND_MIG))
        mib = r.model.memory_mib
        if r.gi is not None:
            mib = _profile_by_id(r, r.gi.profile_id).memory_mib
        total = mib * _MIB
        used = total // 200  # a little driver-reserved memory, as a real idle GPU shows
        if version:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = used
            mem.used = 0
            mem.free = total - used
        else:
            mem = pynvml.c_nvmlMemory_t()
            mem.used = used
            mem.free = total - used
        mem.total = total
        return mem

    return _call("DeviceGetMemoryInfo", handle, body)


def nvmlDeviceGetArchitecture(handle: Any) -> int:
    cfg = _require_init()
    index = _gpu_index_of(cfg, handle, (_KIND_DEVICE, _KIND_MIG))
    return int(_ARCH_CODE[cfg.gpus[index].model.architecture])


def nvmlDeviceGetCudaComputeCapability(handle: Any) -> tuple[int, int]:
    cfg = _require_init()
    index = _gpu_index_of(cfg, handle, (_KIND_DEVICE, _KIND_MIG))
    return cfg.gpus[index].model.cuda_compute_capability


# --- MIG mode ------------------------------------------------------------------------------------


def nvmlDeviceGetMigMode(device: Any) -> list[int]:
    def body(cfg: SimConfig, state: HwState) -> list[int]:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_capable(r)
        return [r.gpu.mig_current, r.gpu.mig_pending]

    return _call("DeviceGetMigMode", device, body)


def nvmlDeviceSetMigMode(device: Any, mode: int) -> int:
    """Returns activationStatus like pynvml; the primary code raises only for call errors."""

    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not cfg.root:
            _raise(pynvml.NVML_ERROR_NO_PERMISSION)
        _require_mig_capable(r)
        gpu = r.gpu
        if gpu.mig_current == mode:
            gpu.mig_pending = mode  # also cancels a pending change on Ampere
            return int(pynvml.NVML_SUCCESS)
        if gpu.gis:
            return int(pynvml.NVML_ERROR_IN_USE)  # MIG devices exist: the toggle is refused
        needs_reset = r.model.architecture.mig_toggle_needs_reset
        if needs_reset and cfg.ampere_reset == "manual":
            gpu.mig_pending = mode
            return int(pynvml.NVML_ERROR_RESET_REQUIRED)
        gpu.mig_current = gpu.mig_pending = mode
        return int(pynvml.NVML_SUCCESS)

    return _call("DeviceSetMigMode", device, body)


# --- GPU-instance profiles and placements --------------------------------------------------------


def _fill_gi_profile(info: Any, prof: ProfileSpec) -> Any:
    info.id = prof.id
    info.isP2pSupported = 0
    info.sliceCount = prof.slices
    info.instanceCount = prof.max_instances
    info.multiprocessorCount = prof.multiprocessors
    info.copyEngineCount = prof.engines.copy
    info.decoderCount = prof.engines.decoders
    info.encoderCount = prof.engines.encoders
    info.jpegCount = prof.engines.jpeg
    info.ofaCount = prof.engines.ofa
    info.memorySizeMB = prof.memory_mib
    if hasattr(info, "name"):
        info.name = f"MIG {prof.name}".encode()
    return info


def nvmlDeviceGetGpuInstanceProfileInfo(device: Any, profile: int, version: int = 2) -> Any:
    if version not in (1, 2):
        _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        _require_mig_capable(r)
        prof = r.model.profile_by_index(profile)
        if prof is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert prof is not None
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
        return _fill_gi_profile(info, prof)

    return _call("DeviceGetGpuInstanceProfileInfo", device, body)


nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo


def nvmlDeviceGetGpuInstanceProfileInfoById(device: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_capable(r)
        prof = next((p for p in r.model.profiles if p.id == profileId), None)
        if prof is None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert prof is not None
        return _fill_gi_profile(pynvml.c_nvmlGpuInstanceProfileInfo_v2_t(), prof)

    return _call("DeviceGetGpuInstanceProfileInfoById", device, body)


nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById


def nvmlDeviceGetGpuInstancePossiblePlacements(
    device: Any, profileId: int, placementsRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_capable(r)
        _require_privilege(cfg)
        prof = _profile_by_id(r, profileId)
        items = []
        for pl in prof.placements:
            c = pynvml.c_nvmlGpuInstancePlacement_t()
            c.start, c.size = pl.start, pl.size
            items.append(c)
        _fill_array(items, placementsRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return _call("DeviceGetGpuInstancePossiblePlacements", device, body)


nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements


def nvmlDeviceGetGpuInstanceRemainingCapacity(device: Any, profileId: int) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        _require_privilege(cfg)
        return remaining_capacity(r.model, r.gpu, _profile_by_id(r, profileId))

    return _call("DeviceGetGpuInstanceRemainingCapacity", device, body)


# --- GPU instances -------------------------------------------------------------------------------


def _create_gi(state: HwState, r: _Resolved, prof: ProfileSpec, pl: Placement) -> Any:
    gi = GiRec(
        id=gi_id_for(r.model, r.gpu.layout, pl),
        profile_id=prof.id,
        start=pl.start,
        size=pl.size,
        serial=state.next_serial(),
    )
    r.gpu.gis.append(gi)
    r.gpu.gis.sort(key=lambda g: g.id)
    return _gi_handle(r.index, gi)


def nvmlDeviceCreateGpuInstance(device: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        _require_privilege(cfg)
        prof = _profile_by_id(r, profileId)
        for pl in auto_placement_order(r.model, r.gpu.layout, prof):
            if gi_fit_error(r.model, r.gpu, prof, pl) is None:
                return _create_gi(state, r, prof, pl)
        return _raise(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    return _call("DeviceCreateGpuInstance", device, body)


def nvmlDeviceCreateGpuInstanceWithPlacement(device: Any, profileId: int, placement: Any) -> Any:
    """``placement`` must be ``ctypes.byref(c_nvmlGpuInstancePlacement_t)``: the C function
    takes a pointer and pynvml forwards the argument unchanged (reference §10)."""
    target = _target(placement)
    if isinstance(target, ctypes._Pointer):
        target = target.contents
    if target is placement or not isinstance(target, pynvml.c_nvmlGpuInstancePlacement_t):
        raise TypeError(
            "nvmlDeviceCreateGpuInstanceWithPlacement needs ctypes.byref(placement): real NVML "
            "reads a pointer here and would misread a struct passed by value"
        )
    wanted = Placement(int(target.start), int(target.size))

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        _require_privilege(cfg)
        prof = _profile_by_id(r, profileId)
        err = gi_fit_error(r.model, r.gpu, prof, wanted)
        if err is not None:
            _raise(err)
        return _create_gi(state, r, prof, wanted)

    return _call("DeviceCreateGpuInstanceWithPlacement", device, body)


def nvmlGpuInstanceDestroy(gpuInstance: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        _require_privilege(cfg)
        assert r.gi is not None
        if r.gi.cis:
            _raise(pynvml.NVML_ERROR_IN_USE)
        r.gpu.gis.remove(r.gi)
        return int(pynvml.NVML_SUCCESS)

    return _call("GpuInstanceDestroy", gpuInstance, body)


def nvmlDeviceGetGpuInstances(
    device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        _require_privilege(cfg)
        prof = _profile_by_id(r, profileId)
        items = [_gi_handle(r.index, gi) for gi in r.gpu.gis if gi.profile_id == prof.id]
        _fill_array(items, gpuInstancesRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return _call("DeviceGetGpuInstances", device, body)


def nvmlDeviceGetGpuInstanceById(device: Any, gpuInstanceId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        _require_privilege(cfg)
        gi = r.gpu.gi(int(gpuInstanceId))
        if gi is None:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        assert gi is not None
        return _gi_handle(r.index, gi)

    return _call("DeviceGetGpuInstanceById", device, body)


def nvmlGpuInstanceGetInfo(gpuInstance: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        assert r.gi is not None
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _device_handle(r.index)
        info.id = r.gi.id
        info.profileId = r.gi.profile_id
        info.placement.start = r.gi.start
        info.placement.size = r.gi.size
        return info

    return _call("GpuInstanceGetInfo", gpuInstance, body)


# --- compute instances ---------------------------------------------------------------------------


def _ci_size_or_raise(r: _Resolved, profile: int) -> tuple[ProfileSpec, int]:
    assert r.gi is not None
    if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    gi_prof = _profile_by_id(r, r.gi.profile_id)
    size = CI_SIZE_FOR_INDEX.get(profile)
    if size is None or size not in ci_sizes(gi_prof.slices):
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert size is not None
    return gi_prof, size


def nvmlGpuInstanceGetComputeInstanceProfileInfo(
    device: Any, profile: int, engProfile: int, version: int = 2
) -> Any:
    """``device`` is the GPU-instance handle (pynvml's parameter name is misleading)."""
    if version not in (1, 2):
        _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_GI,))
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi_prof, size = _ci_size_or_raise(r, profile)
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            base = gi_prof.name if size == gi_prof.slices else f"{size}c.{gi_prof.name}"
            info.name = f"MIG {base}".encode()
        else:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        info.id = profile
        info.sliceCount = size
        info.instanceCount = gi_prof.slices // size
        info.multiprocessorCount = gi_prof.multiprocessors * size // gi_prof.slices
        info.sharedCopyEngineCount = gi_prof.engines.copy
        info.sharedDecoderCount = gi_prof.engines.decoders
        info.sharedEncoderCount = gi_prof.engines.encoders
        info.sharedJpegCount = gi_prof.engines.jpeg
        info.sharedOfaCount = gi_prof.engines.ofa
        return info

    return _call("GpuInstanceGetComputeInstanceProfileInfo", device, body)


nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo


def _ci_room(gi_prof: ProfileSpec, gi: GiRec, profile_id: int, size: int) -> int | None:
    same = sum(1 for c in gi.cis if c.profile_id == profile_id)
    if same >= gi_prof.slices // size or len(gi.cis) >= MAX_CIS_PER_GI:
        return None
    return ci_free_start(gi_prof.slices, gi, size)


def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpuInstance: Any, profileId: int) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        _require_privilege(cfg)
        gi_prof, size = _ci_size_or_raise(r, profileId)
        assert r.gi is not None
        trial = GiRec(r.gi.id, r.gi.profile_id, r.gi.start, r.gi.size, 0, list(r.gi.cis))
        count = 0
        while (start := _ci_room(gi_prof, trial, profileId, size)) is not None:
            trial.cis.append(CiRec(-1, profileId, start, size, 0, ""))
            count += 1
        return count

    return _call("GpuInstanceGetComputeInstanceRemainingCapacity", gpuInstance, body)


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        _require_privilege(cfg)
        gi_prof, size = _ci_size_or_raise(r, profileId)
        gi = r.gi
        assert gi is not None
        start = _ci_room(gi_prof, gi, profileId, size)
        if start is None:
            _raise(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        assert start is not None
        ci_id = min(set(range(MAX_CIS_PER_GI)) - {c.id for c in gi.cis})
        serial = state.next_serial()
        ci = CiRec(
            id=ci_id,
            profile_id=profileId,
            start=start,
            size=size,
            serial=serial,
            uuid=mig_uuid(cfg, r.gpu, gi.id, ci_id, serial),
        )
        gi.cis.append(ci)
        gi.cis.sort(key=lambda c: c.id)
        return _ci_handle(r.index, gi, ci)

    return _call("GpuInstanceCreateComputeInstance", gpuInstance, body)


def nvmlComputeInstanceDestroy(computeInstance: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, computeInstance, (_KIND_CI,))
        _require_privilege(cfg)
        assert r.gi is not None and r.ci is not None
        if r.ci.busy:
            _raise(pynvml.NVML_ERROR_IN_USE)
        r.gi.cis.remove(r.ci)
        return int(pynvml.NVML_SUCCESS)

    return _call("ComputeInstanceDestroy", computeInstance, body)


def nvmlGpuInstanceGetComputeInstances(
    gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        _require_privilege(cfg)
        _ci_size_or_raise(r, profileId)
        assert r.gi is not None
        gi = r.gi
        items = [_ci_handle(r.index, gi, c) for c in gi.cis if c.profile_id == profileId]
        _fill_array(items, computeInstancesRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return _call("GpuInstanceGetComputeInstances", gpuInstance, body)


def nvmlGpuInstanceGetComputeInstanceById(gpuInstance: Any, computeInstanceId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, gpuInstance, (_KIND_GI,))
        _require_privilege(cfg)
        assert r.gi is not None
        if not 0 <= int(computeInstanceId) < MAX_CIS_PER_GI:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ci = next((c for c in r.gi.cis if c.id == int(computeInstanceId)), None)
        if ci is None:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        assert ci is not None
        return _ci_handle(r.index, r.gi, ci)

    return _call("GpuInstanceGetComputeInstanceById", gpuInstance, body)


def nvmlComputeInstanceGetInfo_v2(computeInstance: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, computeInstance, (_KIND_CI,))
        assert r.gi is not None and r.ci is not None
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = _device_handle(r.index)  # the parent GPU, as nvml.h documents
        info.gpuInstance = _gi_handle(r.index, r.gi)
        info.id = r.ci.id
        info.profileId = r.ci.profile_id
        info.placement.start = r.ci.start
        info.placement.size = r.ci.size
        return info

    return _call("ComputeInstanceGetInfo", computeInstance, body)


nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2


# --- MIG device handles --------------------------------------------------------------------------


def nvmlDeviceIsMigDeviceHandle(device: Any) -> Any:
    _require_init()
    kind, *_ = _decode(device)
    return ctypes.c_uint(1 if kind == _KIND_MIG else 0)  # raw c_uint, as pynvml returns


def nvmlDeviceGetGpuInstanceId(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        kind, *_ = _decode(device)
        if kind != _KIND_MIG:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        r = _resolve(cfg, state, device, (_KIND_MIG,))
        assert r.gi is not None
        return r.gi.id

    return _call("DeviceGetGpuInstanceId", device, body)


def nvmlDeviceGetComputeInstanceId(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        kind, *_ = _decode(device)
        if kind != _KIND_MIG:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        r = _resolve(cfg, state, device, (_KIND_MIG,))
        assert r.ci is not None
        return r.ci.id

    return _call("DeviceGetComputeInstanceId", device, body)


def nvmlDeviceGetMaxMigDeviceCount(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        if not r.gpu.mig_capable or r.gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return 0
        return r.model.compute_slices

    return _call("DeviceGetMaxMigDeviceCount", device, body)


def nvmlDeviceGetMigDeviceHandleByIndex(device: Any, index: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, device, (_KIND_DEVICE,))
        _require_mig_enabled(r)
        if not 0 <= int(index) < r.model.compute_slices:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        pairs = [(gi, ci) for gi in r.gpu.gis for ci in gi.cis]  # ordered by (GI id, CI id)
        if int(index) >= len(pairs):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = pairs[int(index)]
        return _mig_handle(r.index, gi, ci)

    return _call("DeviceGetMigDeviceHandleByIndex", device, body)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = _resolve(cfg, state, migDevice, (_KIND_MIG,))
        return _device_handle(r.index)

    return _call("DeviceGetDeviceHandleFromMigDeviceHandle", migDevice, body)


_cfgmod.KNOWN_OPS = tuple(
    sorted(name[4:] for name in list(globals()) if name.startswith("nvml") and name[4].isupper())
)

# --- simulator administration (sim-only; NVML has no equivalent) ---------------------------------


def _admin(body: Callable[[SimConfig, HwState], _T]) -> _T:
    cfg = sim_config()
    with _store(cfg).transaction() as state:
        return body(cfg, state)


def sim_reset_gpu(index: int) -> None:
    """A GPU reset (``nvidia-smi --gpu-reset``): applies a pending MIG mode on Ampere; Hopper
    and later lose MIG mode. Refused with IN_USE while GPU instances exist, as the driver
    refuses to reset a busy GPU."""

    def body(cfg: SimConfig, state: HwState) -> None:
        gpu = state.gpus[index]
        if gpu.gis:
            _raise(pynvml.NVML_ERROR_IN_USE)
        _apply_reset(cfg.gpus[index].model, gpu)

    _admin(body)


def _apply_reset(model: GpuModel, gpu: GpuRec) -> None:
    gpu.gis = []
    if model.architecture.mig_toggle_needs_reset:
        gpu.mig_current = gpu.mig_pending  # persisted in the InfoROM
    else:
        gpu.mig_current = gpu.mig_pending = pynvml.NVML_DEVICE_MIG_DISABLE


def sim_reboot() -> None:
    """A node reboot: every GPU and compute instance is gone; Ampere applies its pending MIG
    mode (it persists), Hopper and later come back with MIG disabled."""

    def body(cfg: SimConfig, state: HwState) -> None:
        for sim_gpu, gpu in zip(cfg.gpus, state.gpus, strict=True):
            _apply_reset(sim_gpu.model, gpu)
        state.boots += 1

    _admin(body)


def sim_inject_fault(
    op: str,
    *,
    error: int | str | None = None,
    kill: bool = False,
    when: str = "before",
    times: int = 1,
    gpu: int | None = None,
    tag: str | None = None,
) -> None:
    """Make ``op`` fail with NVML ``error`` (a code or a name like "INSUFFICIENT_RESOURCES"),
    or kill the calling process with SIGKILL, ``times`` times, ``before`` or ``after`` the
    operation takes effect. Faults live in the state file, so they reach other processes."""
    raw: dict[str, Any] = {"op": op, "when": when, "action": "kill" if kill else "error"}
    raw["times"] = times
    if error is not None:
        raw["error"] = error
    if gpu is not None:
        raw["gpu"] = gpu
    if tag is not None:
        raw["tag"] = tag
    fault = _cfgmod._parse_fault(raw)

    def body(cfg: SimConfig, state: HwState) -> None:
        state.faults.append({**fault.to_json(), "remaining": fault.times})

    _admin(body)


def sim_crash_at(
    point: str, *, times: int = 1, gpu: int | None = None, tag: str | None = None
) -> None:
    """Kill the process at ``"before:<Op>"`` or ``"after:<Op>"`` (sim-only)."""
    when, sep, op = point.partition(":")
    if not sep:
        raise SimConfigError(f"crash point {point!r}: write 'before:<Op>' or 'after:<Op>'")
    sim_inject_fault(op, kill=True, when=when, times=times, gpu=gpu, tag=tag)


def sim_clear_faults() -> None:
    def body(cfg: SimConfig, state: HwState) -> None:
        state.faults = []

    _admin(body)


def sim_set_busy(gpu: int, gi_id: int, ci_id: int, busy: bool = True) -> None:
    """Pretend a process runs on a compute instance, so destroying it gives IN_USE."""

    def body(cfg: SimConfig, state: HwState) -> None:
        gi = state.gpus[gpu].gi(gi_id)
        ci = None if gi is None else next((c for c in gi.cis if c.id == ci_id), None)
        if ci is None:
            raise SimConfigError(f"no compute instance {gpu}/{gi_id}/{ci_id}")
        ci.busy = busy

    _admin(body)


def sim_snapshot() -> dict[str, Any]:
    """The simulated hardware as plain data (GPUs with their GIs and CIs, pending faults)."""
    return _admin(lambda cfg, state: state.to_json())


def sim_proc_root() -> Path:
    """Root of the fake /proc tree (``devices``, ``driver/nvidia-caps/mig-minors``,
    ``driver/nvidia/capabilities/...``). Created on first use of the state."""
    cfg = sim_config()
    _admin(lambda c, s: None)
    return cfg.effective_proc_root


def sim_write_config(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write a config file (YAML) after validating it; returns the path."""
    p = Path(path)
    parse_config(data, p.resolve().parent)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(dict(data), sort_keys=False))
    return p
