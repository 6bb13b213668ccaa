"""Simulated NVML: GPU-instance profiles, placements and GPU instances.

Profiles and placements come from the GPU's catalog model; whether an instance fits at a
placement is decided by ``hardware`` (memory-unit overlap, engine pools, media exclusions,
per-profile caps), so these functions only translate between pynvml's structs and those rules.
"""

# ruff: noqa: N802, N803, N816 -- names and parameters mirror pynvml exactly; that is the point.
from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from driver.catalog import Placement, ProfileSpec
from driver.nvml.sim.calls import (
    call,
    profile_by_id,
    require_mig_capable,
    require_mig_enabled,
    require_privilege,
)
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.handles import (
    KIND_DEVICE,
    KIND_GI,
    Resolved,
    device_handle,
    fill_array,
    gi_handle,
    resolve,
    target,
)
from driver.nvml.sim.hardware import (
    GiRec,
    HwState,
    auto_placement_order,
    gi_fit_error,
    gi_id_for,
    remaining_capacity,
)
from driver.nvml.sim.runtime import raise_nvml

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
        raise_nvml(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        require_mig_capable(r)
        prof = r.model.profile_by_index(profile)
        if prof is None:
            raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert prof is not None
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
        return _fill_gi_profile(info, prof)

    return call("DeviceGetGpuInstanceProfileInfo", device, body)


nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo


def nvmlDeviceGetGpuInstanceProfileInfoById(device: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_capable(r)
        prof = next((p for p in r.model.profiles if p.id == profileId), None)
        if prof is None:
            raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert prof is not None
        return _fill_gi_profile(pynvml.c_nvmlGpuInstanceProfileInfo_v2_t(), prof)

    return call("DeviceGetGpuInstanceProfileInfoById", device, body)


nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById


def nvmlDeviceGetGpuInstancePossiblePlacements(
    device: Any, profileId: int, placementsRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_capable(r)
        require_privilege(cfg)
        prof = profile_by_id(r, profileId)
        items = []
        for pl in prof.placements:
            c = pynvml.c_nvmlGpuInstancePlacement_t()
            c.start, c.size = pl.start, pl.size
            items.append(c)
        fill_array(items, placementsRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return call("DeviceGetGpuInstancePossiblePlacements", device, body)


nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements


def nvmlDeviceGetGpuInstanceRemainingCapacity(device: Any, profileId: int) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        require_privilege(cfg)
        return remaining_capacity(r.model, r.gpu, profile_by_id(r, profileId))

    return call("DeviceGetGpuInstanceRemainingCapacity", device, body)


# --- GPU instances -------------------------------------------------------------------------------


def _create_gi(state: HwState, r: Resolved, prof: ProfileSpec, pl: Placement) -> Any:
    gi = GiRec(
        id=gi_id_for(r.model, r.gpu.layout, pl),
        profile_id=prof.id,
        start=pl.start,
        size=pl.size,
        serial=state.next_serial(),
    )
    r.gpu.gis.append(gi)
    r.gpu.gis.sort(key=lambda g: g.id)
    return gi_handle(r.index, gi)


def nvmlDeviceCreateGpuInstance(device: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        require_privilege(cfg)
        prof = profile_by_id(r, profileId)
        for pl in auto_placement_order(r.model, r.gpu.layout, prof):
            if gi_fit_error(r.model, r.gpu, prof, pl) is None:
                return _create_gi(state, r, prof, pl)
        return raise_nvml(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    return call("DeviceCreateGpuInstance", device, body)


def nvmlDeviceCreateGpuInstanceWithPlacement(device: Any, profileId: int, placement: Any) -> Any:
    """``placement`` must be ``ctypes.byref(c_nvmlGpuInstancePlacement_t)``: the C function
    takes a pointer and pynvml forwards the argument unchanged (reference §10)."""
    struct = target(placement)
    if isinstance(struct, ctypes._Pointer):
        struct = struct.contents
    if struct is placement or not isinstance(struct, pynvml.c_nvmlGpuInstancePlacement_t):
        raise TypeError(
            "nvmlDeviceCreateGpuInstanceWithPlacement needs ctypes.byref(placement): real NVML "
            "reads a pointer here and would misread a struct passed by value"
        )
    wanted = Placement(int(struct.start), int(struct.size))

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        require_privilege(cfg)
        prof = profile_by_id(r, profileId)
        err = gi_fit_error(r.model, r.gpu, prof, wanted)
        if err is not None:
            raise_nvml(err)
        return _create_gi(state, r, prof, wanted)

    return call("DeviceCreateGpuInstanceWithPlacement", device, body)


def nvmlGpuInstanceDestroy(gpuInstance: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        require_privilege(cfg)
        assert r.gi is not None
        if r.gi.cis:
            raise_nvml(pynvml.NVML_ERROR_IN_USE)
        r.gpu.gis.remove(r.gi)
        return int(pynvml.NVML_SUCCESS)

    return call("GpuInstanceDestroy", gpuInstance, body)


def nvmlDeviceGetGpuInstances(
    device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        require_privilege(cfg)
        prof = profile_by_id(r, profileId)
        items = [gi_handle(r.index, gi) for gi in r.gpu.gis if gi.profile_id == prof.id]
        fill_array(items, gpuInstancesRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return call("DeviceGetGpuInstances", device, body)


def nvmlDeviceGetGpuInstanceById(device: Any, gpuInstanceId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        require_privilege(cfg)
        gi = r.gpu.gi(int(gpuInstanceId))
        if gi is None:
            raise_nvml(pynvml.NVML_ERROR_NOT_FOUND)
        assert gi is not None
        return gi_handle(r.index, gi)

    return call("DeviceGetGpuInstanceById", device, body)


def nvmlGpuInstanceGetInfo(gpuInstance: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        assert r.gi is not None
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = device_handle(r.index)
        info.id = r.gi.id
        info.profileId = r.gi.profile_id
        info.placement.start = r.gi.start
        info.placement.size = r.gi.size
        return info

    return call("GpuInstanceGetInfo", gpuInstance, body)
