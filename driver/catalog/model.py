"""The types that describe a MIG-capable GPU model: profiles, placements, engine pools.

They are the same whether a model comes from the static catalogue (``driver.catalog.data``),
from NVML on a node, or from a GPU's ResourceSlices, so nothing downstream depends on where a
model came from. All are frozen and compare by value, so equal models found separately share
one ``driver.geometry`` and its caches.

Profiles are keyed by (index, id, slices), never by name: names drift with the driver version.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum


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


class ProfileIndex(IntEnum):
    """NVML_GPU_INSTANCE_PROFILE_* index constants (nvml.h), the argument of
    nvmlDeviceGetGpuInstanceProfileInfo. Distinct from the profile id that NVML returns."""

    SLICE_1 = 0x0
    SLICE_2 = 0x1
    SLICE_3 = 0x2
    SLICE_4 = 0x3
    SLICE_7 = 0x4
    SLICE_8 = 0x5
    SLICE_6 = 0x6
    SLICE_1_REV1 = 0x7
    SLICE_2_REV1 = 0x8
    SLICE_1_REV2 = 0x9
    SLICE_1_GFX = 0xA
    SLICE_2_GFX = 0xB
    SLICE_4_GFX = 0xC
    SLICE_1_NO_ME = 0xD
    SLICE_2_NO_ME = 0xE
    SLICE_1_ALL_ME = 0xF
    SLICE_2_ALL_ME = 0x10
    SLICE_3_GFX = 0x11


NO_MEDIA_INDICES = frozenset({ProfileIndex.SLICE_1_NO_ME, ProfileIndex.SLICE_2_NO_ME})
"""Profiles without decoders/encoders/JPEG/OFA: the only ones allowed beside an ALL_ME instance."""

ALL_MEDIA_INDICES = frozenset({ProfileIndex.SLICE_1_ALL_ME, ProfileIndex.SLICE_2_ALL_ME})
"""Profiles that take every media engine of the GPU while they exist (nvml.h)."""


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

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end


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

    def counts(self) -> tuple[int, int, int, int, int]:
        """The pools in field order (copy, decoders, encoders, JPEG, OFA), for code that
        handles every pool alike."""
        return (self.copy, self.decoders, self.encoders, self.jpeg, self.ofa)

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

    @property
    def takes_all_media(self) -> bool:
        """A `+me.all` profile: while it exists only `-me` profiles can be created."""
        return self.index in ALL_MEDIA_INDICES

    @property
    def without_media(self) -> bool:
        """A `-me` profile: the only kind that can sit beside a `+me.all` instance."""
        return self.index in NO_MEDIA_INDICES

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(p.start for p in self.placements)


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
    # Placements are often the weakest fact (no `-lgipp` capture for several models), so they
    # carry their own label; per-profile labels cover the other columns of a row.
    placement_evidence: Evidence = Evidence.VERIFIED
    note: str = ""

    @property
    def full_profile(self) -> ProfileSpec:
        """The profile that takes the whole GPU; its engine row is the GPU's engine pool."""
        return max(self.profiles, key=lambda p: (p.size, p.slices, p.multiprocessors))

    @property
    def engine_totals(self) -> Engines:
        # A model without profiles is a GPU that offers no MIG device now (read back from its
        # ResourceSlices): nothing can be carved, so no engine is available to MIG either.
        return self.full_profile.engines if self.profiles else NO_ENGINES

    @property
    def multiprocessors(self) -> int:
        return self.full_profile.multiprocessors if self.profiles else 0

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
