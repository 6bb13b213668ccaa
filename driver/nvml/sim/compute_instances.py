"""Simulated NVML: compute instances inside a GPU instance, and MIG device handles.

A MIG device is a compute instance seen as a device: its handle is a ``c_nvmlDevice_t`` that
names the same (GPU, GI, CI, serial) as the compute instance, so it goes stale with it.
"""

# ruff: noqa: N802, N803, N816 -- names and parameters mirror pynvml exactly; that is the point.
from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from driver.catalog import ProfileSpec
from driver.nvml.sim.calls import call, profile_by_id, require_mig_enabled, require_privilege
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.handles import (
    KIND_CI,
    KIND_DEVICE,
    KIND_GI,
    KIND_MIG,
    Resolved,
    ci_handle,
    decode,
    device_handle,
    fill_array,
    gi_handle,
    mig_handle,
    resolve,
)
from driver.nvml.sim.hardware import (
    CI_SIZE_FOR_INDEX,
    MAX_CIS_PER_GI,
    CiRec,
    GiRec,
    HwState,
    ci_free_start,
    ci_sizes,
    mig_uuid,
)
from driver.nvml.sim.runtime import raise_nvml, require_init

# --- compute instances ---------------------------------------------------------------------------


def _ci_size_or_raise(r: Resolved, profile: int) -> tuple[ProfileSpec, int]:
    assert r.gi is not None
    if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    gi_prof = profile_by_id(r, r.gi.profile_id)
    size = CI_SIZE_FOR_INDEX.get(profile)
    if size is None or size not in ci_sizes(gi_prof.slices):
        raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert size is not None
    return gi_prof, size


def nvmlGpuInstanceGetComputeInstanceProfileInfo(
    device: Any, profile: int, engProfile: int, version: int = 2
) -> Any:
    """``device`` is the GPU-instance handle (pynvml's parameter name is misleading)."""
    if version not in (1, 2):
        raise_nvml(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_GI,))
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
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

    return call("GpuInstanceGetComputeInstanceProfileInfo", device, body)


nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo


def _ci_room(gi_prof: ProfileSpec, gi: GiRec, profile_id: int, size: int) -> int | None:
    same = sum(1 for c in gi.cis if c.profile_id == profile_id)
    if same >= gi_prof.slices // size or len(gi.cis) >= MAX_CIS_PER_GI:
        return None
    return ci_free_start(gi_prof.slices, gi, size)


def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpuInstance: Any, profileId: int) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        require_privilege(cfg)
        gi_prof, size = _ci_size_or_raise(r, profileId)
        assert r.gi is not None
        trial = GiRec(r.gi.id, r.gi.profile_id, r.gi.start, r.gi.size, 0, list(r.gi.cis))
        count = 0
        while (start := _ci_room(gi_prof, trial, profileId, size)) is not None:
            trial.cis.append(CiRec(-1, profileId, start, size, 0, ""))
            count += 1
        return count

    return call("GpuInstanceGetComputeInstanceRemainingCapacity", gpuInstance, body)


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: Any, profileId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        require_privilege(cfg)
        gi_prof, size = _ci_size_or_raise(r, profileId)
        gi = r.gi
        assert gi is not None
        start = _ci_room(gi_prof, gi, profileId, size)
        if start is None:
            raise_nvml(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
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
        return ci_handle(r.index, gi, ci)

    return call("GpuInstanceCreateComputeInstance", gpuInstance, body)


def nvmlComputeInstanceDestroy(computeInstance: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, computeInstance, (KIND_CI,))
        require_privilege(cfg)
        assert r.gi is not None and r.ci is not None
        if r.ci.in_use:
            raise_nvml(pynvml.NVML_ERROR_IN_USE)
        r.gi.cis.remove(r.ci)
        return int(pynvml.NVML_SUCCESS)

    return call("ComputeInstanceDestroy", computeInstance, body)


def nvmlGpuInstanceGetComputeInstances(
    gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        require_privilege(cfg)
        _ci_size_or_raise(r, profileId)
        assert r.gi is not None
        gi = r.gi
        items = [ci_handle(r.index, gi, c) for c in gi.cis if c.profile_id == profileId]
        fill_array(items, computeInstancesRef, countRef)
        return int(pynvml.NVML_SUCCESS)

    return call("GpuInstanceGetComputeInstances", gpuInstance, body)


def nvmlGpuInstanceGetComputeInstanceById(gpuInstance: Any, computeInstanceId: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, gpuInstance, (KIND_GI,))
        require_privilege(cfg)
        assert r.gi is not None
        if not 0 <= int(computeInstanceId) < MAX_CIS_PER_GI:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        ci = next((c for c in r.gi.cis if c.id == int(computeInstanceId)), None)
        if ci is None:
            raise_nvml(pynvml.NVML_ERROR_NOT_FOUND)
        assert ci is not None
        return ci_handle(r.index, r.gi, ci)

    return call("GpuInstanceGetComputeInstanceById", gpuInstance, body)


def nvmlComputeInstanceGetInfo_v2(computeInstance: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, computeInstance, (KIND_CI,))
        assert r.gi is not None and r.ci is not None
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = device_handle(r.index)  # the parent GPU, as nvml.h documents
        info.gpuInstance = gi_handle(r.index, r.gi)
        info.id = r.ci.id
        info.profileId = r.ci.profile_id
        info.placement.start = r.ci.start
        info.placement.size = r.ci.size
        return info

    return call("ComputeInstanceGetInfo", computeInstance, body)


nvmlComputeInstanceGetInfo = nvmlComputeInstanceGetInfo_v2


# --- MIG device handles --------------------------------------------------------------------------


def nvmlDeviceIsMigDeviceHandle(device: Any) -> Any:
    require_init()
    kind, *_ = decode(device)
    return ctypes.c_uint(1 if kind == KIND_MIG else 0)  # raw c_uint, as pynvml returns


def _resolve_mig(cfg: SimConfig, state: HwState, device: Any) -> Resolved:
    """A MIG device handle resolved; NVML answers NOT_SUPPORTED for a whole GPU's handle."""
    kind, *_ = decode(device)
    if kind != KIND_MIG:
        raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return resolve(cfg, state, device, (KIND_MIG,))


def nvmlDeviceGetGpuInstanceId(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve_mig(cfg, state, device)
        assert r.gi is not None
        return r.gi.id

    return call("DeviceGetGpuInstanceId", device, body)


def nvmlDeviceGetComputeInstanceId(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = _resolve_mig(cfg, state, device)
        assert r.ci is not None
        return r.ci.id

    return call("DeviceGetComputeInstanceId", device, body)


def nvmlDeviceGetMaxMigDeviceCount(device: Any) -> int:
    def body(cfg: SimConfig, state: HwState) -> int:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        if not r.gpu.mig_capable or r.gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return 0
        return r.model.compute_slices

    return call("DeviceGetMaxMigDeviceCount", device, body)


def nvmlDeviceGetMigDeviceHandleByIndex(device: Any, index: int) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, device, (KIND_DEVICE,))
        require_mig_enabled(r)
        if not 0 <= int(index) < r.model.compute_slices:
            raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        pairs = [(gi, ci) for gi in r.gpu.gis for ci in gi.cis]  # ordered by (GI id, CI id)
        if int(index) >= len(pairs):
            raise_nvml(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = pairs[int(index)]
        return mig_handle(r.index, gi, ci)

    return call("DeviceGetMigDeviceHandleByIndex", device, body)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: Any) -> Any:
    def body(cfg: SimConfig, state: HwState) -> Any:
        r = resolve(cfg, state, migDevice, (KIND_MIG,))
        return device_handle(r.index)

    return call("DeviceGetDeviceHandleFromMigDeviceHandle", migDevice, body)
