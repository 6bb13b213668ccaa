"""Values the NVML backend returns: plain, frozen, and free of NVML handles.

Handles are process-local and go stale when instances change, so nothing here holds one; the
identity of an instance is (GPU UUID, GI id) plus its profile and placement, which is what a
checkpoint can record and compare after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.catalog import Architecture, Placement, ProfileSpec


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML reports it, with the GPU-instance profiles it offers."""

    index: int  # NVML enumeration index (not stable across reboots; use uuid or minor)
    uuid: str  # "GPU-..."
    minor: int  # /dev/nvidia<minor>; also the "gpu" number of the nvidia-caps minors
    name: str  # nvmlDeviceGetName, e.g. "NVIDIA A100-SXM4-40GB"
    architecture: Architecture | None  # None for architectures carve does not know
    architecture_code: int  # NVML_DEVICE_ARCH_*
    memory_mib: int
    pci_bus_id: str  # "00000000:18:00.0", as NVML prints it (driver.pcie has the standard form)
    pci_device_id: int  # e.g. 0x20B0
    driver_version: str
    cuda_compute_capability: tuple[int, int]
    mig_capable: bool
    profiles: tuple[ProfileSpec, ...]  # discovered from NVML; empty when not MIG-capable
    # nvmlDeviceGetBrand, named as NVIDIA's DRA driver names it ("Nvidia", "Tesla", ...)
    brand: str
    # nvmlSystemGetCudaDriverVersion as "<major>.<minor>" ("13.0"): the newest CUDA the driver
    # supports, the same for every GPU of the node
    cuda_driver_version: str
    # nvmlDeviceGetAddressingMode: "HMM", "ATS" or "None"; None where the platform, the driver
    # or the binding cannot say (NVIDIA's driver then publishes no addressingMode either)
    addressing_mode: str | None

    @property
    def product_name(self) -> str:
        return self.name

    @property
    def mig_toggle_needs_reset(self) -> bool:
        """Ampere applies a MIG-mode change only after a GPU reset; later architectures at once."""
        return self.architecture is None or self.architecture.mig_toggle_needs_reset

    def profile(self, profile_id: int) -> ProfileSpec | None:
        return next((p for p in self.profiles if p.id == profile_id), None)


@dataclass(frozen=True)
class MigMode:
    current: bool
    pending: bool

    @property
    def change_pending(self) -> bool:
        """True when a mode change waits for a GPU reset (Ampere)."""
        return self.current != self.pending


@dataclass(frozen=True)
class ComputeInstance:
    id: int
    profile_id: int  # compute-instance profile id (== its index constant)
    slices: int  # compute slices it spans (placement size)
    mig_uuid: str | None  # None only if NVML lists no MIG device for it


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance that exists now, with its compute instances."""

    gpu_uuid: str
    gi_id: int
    profile_id: int
    placement: Placement
    compute_instances: tuple[ComputeInstance, ...]

    @property
    def ci_ids(self) -> tuple[int, ...]:
        return tuple(ci.id for ci in self.compute_instances)

    @property
    def mig_uuid(self) -> str | None:
        """The MIG device of a GI carved the carve way (exactly one full-size CI)."""
        if len(self.compute_instances) != 1:
            return None
        return self.compute_instances[0].mig_uuid


@dataclass(frozen=True)
class CarvedInstance:
    """A GPU instance with its full-size compute instance, ready to hand to a container."""

    gpu_uuid: str
    gpu_minor: int
    gi_id: int
    ci_id: int
    profile_id: int
    placement: Placement
    mig_uuid: str


@dataclass(frozen=True)
class CapDevice:
    """A /dev/nvidia-caps character device a container needs for one MIG device."""

    path: str  # /dev/nvidia-caps/nvidia-cap<minor>
    major: int
    minor: int


@dataclass(frozen=True)
class Unusable:
    """Why a GPU of the node cannot be used now. ``kind`` is ``lost`` (GPU_IS_LOST: fallen off
    the bus), ``unresponsive`` (an NVML call on it overran its deadline and has not returned)
    or ``failing`` (any other NVML error while it was enumerated); ``uuid`` is None when it was
    never read in this process."""

    kind: str
    why: str
    uuid: str | None = None
