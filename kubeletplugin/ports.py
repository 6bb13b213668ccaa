"""The node agent's ports: what its core is called through and what it calls out to.

The kubelet's gRPC adapter (kubeletplugin.draservice) and carve-before-bind
(kubeletplugin.precarve) drive a `ClaimPreparer`; the preparer drives the GPUs through a
`MigBackend` (driver.nvml.backend on NVML or its simulator). Both sides meet here, so that the
prepare state machine, its tests and the crash-test workers never load gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from driver.catalog import GpuModel, Placement
from driver.nvml.types import CarvedInstance, GpuInfo, GpuInstance, Unusable


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it; everything else must be read from the API."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    """One device made usable for a claim, as the kubelet hands it to the container runtime."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    """Outcome for one claim: its devices, or a non-empty error (then the devices are ignored)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    reason: str = ""  # with an error: its short cause (e.g. "carve-failed"), for precarve


class ClaimPreparer(Protocol):
    """The node agent's prepare/unprepare logic, free of any gRPC concern."""

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """Prepare every claim; the result is keyed by claim UID with an entry for each claim."""
        ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare every claim; the result maps claim UID to an error ("" means done)."""
        ...


class ClaimError(Exception):
    """A claim that cannot be (un)prepared; `reason` labels the error metric, the message goes
    to the kubelet and from there to the pod's events."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class MigBackend(Protocol):
    """The slice of the NVML backend the state machine uses (see driver.nvml.backend)."""

    def gpus(self) -> Sequence[GpuInfo]: ...
    def unusable(self) -> Mapping[int, Unusable]: ...
    def gpu_model(self, gpu_uuid: str) -> GpuModel: ...
    def mig_enabled(self, gpu_uuid: str) -> bool: ...
    def enable_mig(self, gpu_uuid: str) -> object: ...
    def disable_mig(self, gpu_uuid: str) -> object: ...
    def instances(self, gpu_uuid: str) -> Sequence[GpuInstance]: ...
    def carve(self, gpu_uuid: str, profile_id: int, placement_start: int) -> CarvedInstance: ...
    def ensure_compute_instance(self, gpu_uuid: str, gi_id: int) -> CarvedInstance: ...
    def destroy(
        self,
        gpu_uuid: str,
        gi_id: int,
        *,
        expect_profile_id: int | None = None,
        expect_placement: Placement | None = None,
    ) -> None: ...
    def running_processes(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, ...]: ...
    def caps_major(self) -> int: ...
    def boot_id(self) -> str | None: ...
    def cap_minors(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]: ...
