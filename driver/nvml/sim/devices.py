"""Simulated NVML: the system, whole-GPU queries and MIG mode.

What a GPU reports comes from its catalog model (names, PCI ids, memory, architecture) and its
record in the state file (UUID, bus id, minor, MIG mode), so every process on the simulated node
sees the same GPUs. MIG-mode changes follow the architecture: Ampere leaves the new mode pending
until a GPU reset (unless the config asks for ``ampere_reset: auto``), Hopper and later apply it
at once.

``nvmlDeviceSetMigMode`` follows nvml.h and pynvml: the call itself raises only for its primary
errors (INVALID_ARGUMENT, NO_PERMISSION, NOT_SUPPORTED); a change the driver cannot activate is
the *returned* activationStatus: IN_USE while GPU instances or processes (``sim_set_gpu_clients``)
hold the GPU, RESET_REQUIRED when Ampere leaves the change pending. Reference
(mig-and-nvml.md §11) verifies IN_USE for Ampere; for Hopper it is unverified, and the simulator
refuses the same way, which is the cautious reading.
"""

# ruff: noqa: N802, N816 -- names mirror pynvml exactly; that is the point.
from __future__ import annotations

from typing import Any

import pynvml

from driver.catalog import Architecture
from driver.nvml.sim.calls import call, profile_by_id, require_mig_capable
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.handles import (
    KIND_DEVICE,
    KIND_MIG,
    device_handle,
    gpu_index_of,
    mig_handle,
    resolve,
)
from driver.nvml.sim.hardware import HwState
from driver.nvml.sim.runtime import raise_nvml, require_init

_MIB = 1024 * 1024

_ARCH_CODE = {
    Architecture.AMPERE: pynvml.NVML_DEVICE_ARCH_AMPERE,
    Architecture.HOPPER: pynvml.NVML_DEVICE_ARCH_HOPPER,
    Architecture.BLACKWELL: pynvml.NVML_DEVICE_ARCH_BLACKWELL,
}

# --- system and devices --------------------------------------------------------------------------


def nvmlSystemGetDriverVersion() -> str:
    return require_init().driver_version


def nvmlSystemGetCudaDriverVersion() -> int:
    return require_init().cuda_driver_version


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlDeviceGetCount() -> int:
    return len(require_init().gpus)


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    cfg = require_init()
    if not 0 <= int(index) < len(cfg.gpus):
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return device_handle(int(index))


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> Any:
    wanted = uuid.decode() if isinstance(uuid, bytes) else uuid

    def body(cfg: SimConfig, state: HwState) -> Any:
        for i, gpu in enumerate(state.gpus):
            if gpu.uuid == wanted:
                if gpu.lost:
                    raise_nvml(pynvml.NVML_ERROR_GPU_IS_LOST)
                return device_handle(i)
            for gi in gpu.gis:
                for ci in gi.cis:
                    if ci.uuid == wanted:
                        return mig_handle(i, gi, ci)
        return raise_nvml(pynvml.NVML_ERROR_NOT_FOUND)

    return call("DeviceGetHandleByUUID", None, body)


def nvmlDeviceGetIndex(handle: Any) -> int:
    return gpu_index_of(require_init(), handle, (KIND_DEVICE,))


def nvmlDeviceGetUUID(handle: Any) -> str:
    def body(cfg: SimConfig, state: HwState) -> str:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        return r.ci.uuid if r.ci is not None else r.gpu.uuid

    return call("DeviceGetUUID", handle, body)


def nvmlDeviceGetName(handle: Any) -> str:
    def body(cfg: SimConfig, state: HwState) -> str:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        if r.gi is None:
            return r.model.product_name
        return f"{r.model.product_name} MIG {profile_by_id(r, r.gi.profile_id).name}"

    return call("DeviceGetName", handle, body)


def nvmlDeviceGetMinorNumber(handle: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        if r.gi is not None:
            raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return r.gpu.minor

    return call("DeviceGetMinorNumber", handle, body)


def nvmlDeviceGetPciInfo_v3(handle: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
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

    return call("DeviceGetPciInfo", handle, body)


nvmlDeviceGetPciInfo = nvmlDeviceGetPciInfo_v3


def nvmlDeviceGetMemoryInfo(handle: Any, version: int | None = None) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        mib = r.model.memory_mib
        if r.gi is not None:
            mib = profile_by_id(r, r.gi.profile_id).memory_mib
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

    return call("DeviceGetMemoryInfo", handle, body)


def nvmlDeviceGetArchitecture(handle: Any) -> int:
    cfg = require_init()
    index = gpu_index_of(cfg, handle, (KIND_DEVICE, KIND_MIG))
    return int(_ARCH_CODE[cfg.gpus[index].model.architecture])


def nvmlDeviceGetCudaComputeCapability(handle: Any) -> tuple[int, int]:
    cfg = require_init()
    index = gpu_index_of(cfg, handle, (KIND_DEVICE, KIND_MIG))
    return cfg.gpus[index].model.cuda_compute_capability


def nvmlDeviceGetBrand(handle: Any) -> int:
    """nvmlBrandType_t (options.brand; NVML_BRAND_NVIDIA by default). A MIG device handle
    answers for its GPU, as the name and architecture queries do here."""

    def body(cfg: SimConfig, state: HwState) -> int:
        resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        return cfg.brand

    return call("DeviceGetBrand", handle, body)


def nvmlDeviceGetAddressingMode(device: Any) -> int:
    """NVML_DEVICE_ADDRESSING_MODE_* as pynvml returns it (the struct's ``value``);
    NOT_SUPPORTED where options.addressing_mode is ``unsupported`` (a platform with neither
    HMM nor ATS, nvml.h). A driver too old to have the call is a fault away:
    ``{op: DeviceGetAddressingMode, error: FUNCTION_NOT_FOUND}``, as pynvml raises it."""

    def body(cfg: SimConfig, state: HwState) -> int:
        resolve(cfg, state, device, (KIND_DEVICE, KIND_MIG))
        if cfg.addressing_mode is None:
            raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert cfg.addressing_mode is not None
        return cfg.addressing_mode

    return call("DeviceGetAddressingMode", device, body)


# --- MIG mode ------------------------------------------------------------------------------------


def nvmlDeviceGetMigMode(device: Any) -> list[int]:
    def body(cfg: SimConfig, state: HwState) -> list[int]:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_capable(r)
        return [r.gpu.mig_current, r.gpu.mig_pending]

    return call("DeviceGetMigMode", device, body)


def nvmlDeviceSetMigMode(device: Any, mode: int) -> int:
    """Returns activationStatus like pynvml; the primary code raises only for call errors."""

    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not cfg.root:
            raise_nvml(pynvml.NVML_ERROR_NO_PERMISSION)
        require_mig_capable(r)
        gpu = r.gpu
        if gpu.mig_current == mode:
            gpu.mig_pending = mode  # also cancels a pending change on Ampere
            return int(pynvml.NVML_SUCCESS)
        if gpu.gis or gpu.clients:
            # MIG devices or processes hold the GPU: it cannot be unbound, the toggle is refused
            return int(pynvml.NVML_ERROR_IN_USE)
        needs_reset = r.model.architecture.mig_toggle_needs_reset
        if needs_reset and cfg.ampere_reset == "manual":
            gpu.mig_pending = mode
            return int(pynvml.NVML_ERROR_RESET_REQUIRED)
        gpu.mig_current = gpu.mig_pending = mode
        return int(pynvml.NVML_SUCCESS)

    return call("DeviceSetMigMode", device, body)
