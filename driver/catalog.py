"""Static facts about MIG-capable GPU models.

The catalog feeds the NVML simulator and the tests. On real hardware the kubelet plugin discovers
profiles from NVML instead, so nothing in the product may depend on a model being listed here.
Every profile keeps the evidence label of the reference it came from (VERIFIED / INFERRED /
UNVERIFIED), so a reader can tell measured facts from educated guesses.

Profiles are keyed by (index, id, slices), never by name: names drift with the driver version.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Evidence(StrEnum):
    VERIFIED = "VERIFIED"
    INFERRED = "INFERRED"
    UNVERIFIED = "UNVERIFIED"


class Architecture(StrEnum):
    AMPERE = "Ampere"
    HOPPER = "Hopper"
    BLACKWELL = "Blackwell"

    @property
    def mig_toggle_needs_reset(self) -> bool:
        """Ampere applies a MIG-mode change only after a GPU reset; Hopper and later at once."""
        return self is Architecture.AMPERE


@dataclass(frozen=True, order=True)
class Placement:
    """A GPU-instance placement: memory units [start, start + size)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def mask(self) -> int:
        """Bit i set when memory unit i is occupied by this placement."""
        return ((1 << self.size) - 1) << self.start


@dataclass(frozen=True)
class Engines:
    """Counted engine pools; a GPU's totals equal its full-size profile's row."""

    copy: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int

    def __add__(self, other: Engines) -> Engines:
        return Engines(
            self.copy + other.copy,
            self.decoders + other.decoders,
            self.encoders + other.encoders,
            self.jpeg + other.jpeg,
            self.ofa + other.ofa,
        )

    def __sub__(self, other: Engines) -> Engines:
        return Engines(
            self.copy - other.copy,
            self.decoders - other.decoders,
            self.encoders - other.encoders,
            self.jpeg - other.jpeg,
            self.ofa - other.ofa,
        )

    def fits_within(self, limit: Engines) -> bool:
        return (
            self.copy <= limit.copy
            and self.decoders <= limit.decoders
            and self.encoders <= limit.encoders
            and self.jpeg <= limit.jpeg
            and self.ofa <= limit.ofa
        )


NO_ENGINES = Engines(0, 0, 0, 0, 0)


@dataclass(frozen=True)
class ProfileSpec:
    """One GPU-instance profile as NVML describes it."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_* constant passed to GetGpuInstanceProfileInfo
    id: int  # info.id, passed to every later call (placements, create, capacity)
    name: str  # e.g. "1g.10gb+me"; for display only, never a key
    memory_mib: int
    slices: int  # compute slices (the "g" in the name)
    multiprocessors: int
    engines: Engines
    max_instances: int
    placements: tuple[Placement, ...]
    evidence: Evidence
    note: str = ""

    @property
    def size(self) -> int:
        """Memory units one instance of this profile occupies."""
        return self.placements[0].size


@dataclass(frozen=True)
class GpuModel:
    """A GPU product with its MIG geometry."""

    key: str  # catalog key, e.g. "A100-SXM4-40GB"
    product_name: str  # what nvmlDeviceGetName returns
    pci_device_ids: tuple[int, ...]
    architecture: Architecture
    memory_mib: int  # total device memory
    memory_units: int  # placement units: 8, 4 or 12
    compute_slices: int  # 7 or 4
    cuda_compute_capability: tuple[int, int]
    profiles: tuple[ProfileSpec, ...]

    @property
    def full_profile(self) -> ProfileSpec:
        """The profile that takes the whole GPU; its engine row is the GPU's engine pool."""
        return max(self.profiles, key=lambda p: (p.size, p.slices, p.multiprocessors))

    @property
    def engine_totals(self) -> Engines:
        return self.full_profile.engines

    @property
    def multiprocessors(self) -> int:
        return self.full_profile.multiprocessors

    def profile_by_id(self, profile_id: int) -> ProfileSpec:
        for p in self.profiles:
            if p.id == profile_id:
                return p
        raise KeyError(f"{self.key} has no GPU-instance profile with id {profile_id}")

    def profile_by_index(self, index: int) -> ProfileSpec | None:
        for p in self.profiles:
            if p.index == index:
                return p
        return None
