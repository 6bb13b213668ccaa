"""What a GPU is, read from NVML: its identity, the attributes carve publishes for it, and
its MIG profiles and placements, discovered by walking NVML's profile indices.

Nothing here changes the GPU; the backend caches what these functions return (reference:
mig-and-nvml.md §9-§11).
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from driver.catalog import Architecture, Engines, Evidence, GpuModel, Placement, ProfileSpec
from driver.nvml import errors
from driver.nvml.calls import call, code_of, translating
from driver.nvml.errors import NotSupported
from driver.nvml.types import GpuInfo

_MIB = 1024 * 1024
_GI_PROFILE_COUNT = 0x12  # nvml.h NVML_GPU_INSTANCE_PROFILE_COUNT

_ARCHITECTURES = {7: Architecture.AMPERE, 9: Architecture.HOPPER, 10: Architecture.BLACKWELL}

# nvmlBrandType_t -> the name NVIDIA's DRA driver publishes as the `brand` attribute (go-nvlib
# GetBrandAsString), so a selector such as `brand == "Nvidia"` ports unchanged. An A100 on a
# 580 driver reports NVML_BRAND_NVIDIA (kubernetes-sigs/dra-driver-nvidia-gpu#717).
_BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
# nvmlDeviceAddressingModeType_t -> the `addressingMode` attribute's value (go-nvlib names).
_ADDRESSING_MODES = {0: "None", 1: "HMM", 2: "ATS"}


def describe(nv: Any, index: int, uuid: str, handle: Any) -> GpuInfo:
    """Everything carve publishes about one GPU, read from NVML once (NVML keeps it stable
    for the process lifetime), with its MIG profiles discovered rather than looked up."""
    with translating(nv, "describe the GPU", uuid):
        name = nv.nvmlDeviceGetName(handle)
        minor = nv.nvmlDeviceGetMinorNumber(handle)
        pci = nv.nvmlDeviceGetPciInfo(handle)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        arch_code = int(nv.nvmlDeviceGetArchitecture(handle))
        cc = nv.nvmlDeviceGetCudaComputeCapability(handle)
        driver_version = nv.nvmlSystemGetDriverVersion()
        brand = int(nv.nvmlDeviceGetBrand(handle))
        cuda_version = int(nv.nvmlSystemGetCudaDriverVersion())
    addressing_mode = _addressing_mode(nv, uuid, handle)
    bus_id = pci.busId.decode() if isinstance(pci.busId, bytes) else str(pci.busId)
    try:
        nv.nvmlDeviceGetMigMode(handle)
        mig_capable = True
    except nv.NVMLError as exc:
        if code_of(nv, exc) != errors.NVML_ERROR_NOT_SUPPORTED:
            raise errors.from_code(int(exc.value), "read MIG mode", gpu=uuid) from exc
        mig_capable = False
    profiles = _discover_profiles(nv, uuid, handle) if mig_capable else ()
    return GpuInfo(
        index=index,
        uuid=uuid,
        minor=int(minor),
        name=str(name),
        architecture=_ARCHITECTURES.get(arch_code),
        architecture_code=arch_code,
        memory_mib=int(memory.total) // _MIB,
        pci_bus_id=bus_id,
        pci_device_id=int(pci.pciDeviceId) >> 16,
        driver_version=str(driver_version),
        cuda_compute_capability=(int(cc[0]), int(cc[1])),
        mig_capable=mig_capable,
        profiles=profiles,
        brand=_brand_name(brand),
        cuda_driver_version=_cuda_version_text(cuda_version),
        addressing_mode=addressing_mode,
    )


def _addressing_mode(nv: Any, uuid: str, handle: Any) -> str | None:
    """nvmlDeviceGetAddressingMode, or None where it cannot be asked or answered.

    The call is recent: an older nvidia-ml-py lacks the function, an older driver's library
    the symbol (pynvml raises FUNCTION_NOT_FOUND), and platforms without HMM or ATS support
    answer NOT_SUPPORTED. NVIDIA's driver (go-nvlib GetAddressingModeAsString) then
    publishes no `addressingMode`, and so does carve. Any other failure is an NVML error
    like every other one while describing a GPU.
    """
    query = getattr(nv, "nvmlDeviceGetAddressingMode", None)
    if query is None:
        return None
    try:
        value = query(handle)
    except nv.NVMLError as exc:
        if code_of(nv, exc) in (
            errors.NVML_ERROR_NOT_SUPPORTED,
            errors.NVML_ERROR_FUNCTION_NOT_FOUND,
        ):
            return None
        raise errors.from_code(int(exc.value), "read the addressing mode", gpu=uuid) from exc
    return _addressing_mode_name(int(value))


def _discover_profiles(nv: Any, uuid: str, handle: Any) -> tuple[ProfileSpec, ...]:
    """Loop the profile index 0..COUNT-1 as nvml.h prescribes; absent indices give
    NOT_SUPPORTED and out-of-range ones INVALID_ARGUMENT, both skipped."""
    profiles = []
    for index in range(_GI_PROFILE_COUNT):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(handle, index, 2)
        except nv.NVMLError as exc:
            if code_of(nv, exc) in (
                errors.NVML_ERROR_NOT_SUPPORTED,
                errors.NVML_ERROR_INVALID_ARGUMENT,
            ):
                continue
            raise errors.from_code(int(exc.value), "read MIG profiles", gpu=uuid) from exc
        raw_name = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        placements = _placements(nv, uuid, handle, int(info.id))
        if not placements:
            continue  # a profile with nowhere to go cannot be carved
        profiles.append(
            ProfileSpec(
                index=index,
                id=int(info.id),
                name=raw_name.removeprefix("MIG ").strip(),
                memory_mib=int(info.memorySizeMB),
                slices=int(info.sliceCount),
                multiprocessors=int(info.multiprocessorCount),
                engines=Engines(
                    copy=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg=int(info.jpegCount),
                    ofa=int(info.ofaCount),
                ),
                max_instances=int(info.instanceCount),
                placements=placements,
                evidence=Evidence.VERIFIED,
                note="discovered from NVML",
            )
        )
    return tuple(profiles)


def _placements(nv: Any, uuid: str, handle: Any, profile_id: int) -> tuple[Placement, ...]:
    count = ctypes.c_uint(0)
    what = f"list placements of profile id {profile_id}"
    call(
        nv,
        what,
        uuid,
        nv.nvmlDeviceGetGpuInstancePossiblePlacements,
        handle,
        profile_id,
        None,
        ctypes.byref(count),
    )
    if count.value == 0:
        return ()
    array = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
    call(
        nv,
        what,
        uuid,
        nv.nvmlDeviceGetGpuInstancePossiblePlacements,
        handle,
        profile_id,
        array,
        ctypes.byref(count),
    )
    return tuple(
        sorted(Placement(int(array[i].start), int(array[i].size)) for i in range(count.value))
    )


def model_of(info: GpuInfo) -> GpuModel:
    """The GPU's MIG geometry as NVML reports it (evidence VERIFIED): what the geometry
    module and the ResourceSlice builder need, with no catalog lookup."""
    gpu_uuid = info.uuid
    if not info.profiles:
        raise NotSupported(f"{gpu_uuid} ({info.name}) offers no MIG profiles", gpu=gpu_uuid)
    if info.architecture is None:
        raise NotSupported(
            f"{gpu_uuid} ({info.name}) has NVML architecture code "
            f"{info.architecture_code}, which carve does not know yet",
            gpu=gpu_uuid,
        )
    return GpuModel(
        key=_slug(info.name),
        product_name=info.name,
        pci_device_ids=(info.pci_device_id,),
        architecture=info.architecture,
        memory_mib=info.memory_mib,
        memory_units=max(pl.end for p in info.profiles for pl in p.placements),
        compute_slices=max(p.slices for p in info.profiles),
        cuda_compute_capability=info.cuda_compute_capability,
        profiles=info.profiles,
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _brand_name(code: int) -> str:
    """The `brand` attribute for an nvmlBrandType_t. Codes NVIDIA's driver has no name for
    (newer than its table) read "Unknown", so a selector on `brand` still evaluates."""
    return _BRANDS.get(code, "Unknown")


def _cuda_version_text(version: int) -> str:
    """nvmlSystemGetCudaDriverVersion's integer (1000 * major + 10 * minor, e.g. 13000 or
    12080) as "<major>.<minor>", the way NVIDIA's driver turns it into `cudaDriverVersion`."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _addressing_mode_name(value: int) -> str | None:
    """The `addressingMode` attribute for an nvmlDeviceAddressingModeType_t; None for a value
    this code does not know (a newer mode: publish nothing rather than a wrong name)."""
    return _ADDRESSING_MODES.get(value)
