"""Reading the compute instances inside a GPU instance: their profiles, the instances that
exist, and the MIG device UUID of each (GI id, CI id).

The backend creates one full-size compute instance per GPU instance; these reads find it
again after a restart and name its MIG device, which NVML only tells through the MIG device
handles, not through the compute instance itself (reference: mig-and-nvml.md §12).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from driver.catalog import ProfileSpec
from driver.nvml import errors
from driver.nvml.calls import call, code_of, translating
from driver.nvml.errors import NotSupported

# nvml.h
_CI_PROFILE_COUNT = 0x9
_CI_PROFILE_1_SLICE_REV1 = 0x7  # media-extension CI profile; carve wants the plain full-size one
_CI_ENGINE_PROFILE_SHARED = 0


@dataclass(frozen=True)
class CiProfile:
    """A compute-instance profile a GPU instance offers."""

    id: int
    slices: int
    max_instances: int


def profiles(nv: Any, uuid: str, gi: Any) -> tuple[CiProfile, ...]:
    """Every compute-instance profile of the GPU instance ``gi`` (shared engines), walking
    NVML's profile indices; absent or out-of-range indices are skipped as nvml.h prescribes."""
    out = []
    for index in range(_CI_PROFILE_COUNT):
        if index == _CI_PROFILE_1_SLICE_REV1:
            continue
        try:
            info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, _CI_ENGINE_PROFILE_SHARED, 2
            )
        except nv.NVMLError as exc:
            if code_of(nv, exc) in (
                errors.NVML_ERROR_NOT_SUPPORTED,
                errors.NVML_ERROR_INVALID_ARGUMENT,
            ):
                continue
            raise errors.from_code(
                int(exc.value), "read compute-instance profiles", gpu=uuid
            ) from exc
        out.append(CiProfile(int(info.id), int(info.sliceCount), int(info.instanceCount)))
    return tuple(out)


def full_size(offered: tuple[CiProfile, ...], uuid: str, profile: ProfileSpec) -> CiProfile:
    """The compute-instance profile that spans the whole GPU instance of ``profile``."""
    for ci_profile in offered:
        if ci_profile.slices == profile.slices:
            return ci_profile
    raise NotSupported(
        f"{uuid}: {profile.name} offers no full-size compute-instance profile", gpu=uuid
    )


def listed(
    nv: Any, uuid: str, gi: Any, offered: tuple[CiProfile, ...]
) -> list[tuple[int, int, int, Any]]:
    """(CI id, CI profile id, slices, handle) of every compute instance in ``gi``, by id."""
    found = []
    for ci_profile in offered:
        capacity = max(ci_profile.max_instances, 1)
        array = (nv.c_nvmlComputeInstance_t * capacity)()
        count = ctypes.c_uint(capacity)
        call(
            nv,
            "list compute instances",
            uuid,
            nv.nvmlGpuInstanceGetComputeInstances,
            gi,
            ci_profile.id,
            array,
            ctypes.byref(count),
        )
        for i in range(count.value):
            ci_info = call(
                nv, "read a compute instance", uuid, nv.nvmlComputeInstanceGetInfo, array[i]
            )
            found.append((int(ci_info.id), ci_profile.id, ci_profile.slices, array[i]))
    return sorted(found, key=lambda f: f[0])


def mig_uuids(nv: Any, uuid: str, handle: Any) -> dict[tuple[int, int], str]:
    """(GI id, CI id) -> MIG UUID, by walking the GPU's MIG device handles (the compute
    instance's info names the parent GPU, not the MIG device)."""
    out: dict[tuple[int, int], str] = {}
    limit = call(nv, "count MIG devices", uuid, nv.nvmlDeviceGetMaxMigDeviceCount, handle)
    for index in range(int(limit)):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except nv.NVMLError as exc:
            if code_of(nv, exc) in (
                errors.NVML_ERROR_NOT_FOUND,
                errors.NVML_ERROR_INVALID_ARGUMENT,
            ):
                continue  # an empty slot: the index space need not be dense
            raise errors.from_code(int(exc.value), "walk MIG devices", gpu=uuid) from exc
        with translating(nv, "read a MIG device", uuid):
            key = (
                int(nv.nvmlDeviceGetGpuInstanceId(mig)),
                int(nv.nvmlDeviceGetComputeInstanceId(mig)),
            )
            out[key] = str(nv.nvmlDeviceGetUUID(mig))
    return out
