"""From an allocated claim to the devices this node must make: checked, before anything changes.

Everything a prepare can refuse without touching a GPU is refused here, with the message the
claim's user reads: devices of another node or of no GPU here, a profile or placement the GPU
does not have, two devices of the claim on overlapping slices, bad opaque config, MPS settings
the node cannot apply. Pure: the caller reads the claim and owns every side effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from driver.allocation import AllocatedDevice
from driver.catalog import Placement, ProfileSpec
from driver.config import ConfigError, MpsConfig, SharingStrategy, resolve_config
from driver.naming import DevicePlace, parse_device_name
from driver.nvml.types import GpuInfo
from kubeletplugin.checkpoint import DeviceRecord
from kubeletplugin.claims import ClaimSnapshot, describe_results
from kubeletplugin.ports import ClaimError
from kubeletplugin.wording import gpu_label


@dataclass(frozen=True)
class PlannedDevice:
    """One allocated device as this node will make it."""

    result: AllocatedDevice
    gpu: GpuInfo
    profile: ProfileSpec | None  # None: the whole GPU
    placement: Placement | None
    env: Mapping[str, str]
    mps: MpsConfig | None = None  # MPS sharing asked for this device

    @property
    def place(self) -> DevicePlace | None:
        """(profile id, placement start) of a MIG device; None for the whole GPU."""
        if self.profile is None or self.placement is None:
            return None
        return (self.profile.id, self.placement.start)

    def record(self) -> DeviceRecord:
        return DeviceRecord(
            device_name=self.result.device,
            request_names=(self.result.request,),
            pool_name=self.result.pool,
            gpu_uuid=self.gpu.uuid,
            gpu_minor=self.gpu.minor,
            profile_id=None if self.profile is None else self.profile.id,
            placement_start=None if self.placement is None else self.placement.start,
            placement_size=None if self.placement is None else self.placement.size,
        )


@dataclass(frozen=True)
class NodeIdentity:
    driver_name: str
    node_name: str
    pool_name: str


class GpuRefusedError(ClaimError):
    """The device is on a GPU the node refuses (foreign instances under policy refuse-gpu)."""

    def __init__(self, message: str, gpu_uuid: str, place: DevicePlace | None) -> None:
        super().__init__("gpu-refused", message)
        self.gpu_uuid = gpu_uuid
        self.place = place


def plan_devices(
    claim: ClaimSnapshot,
    node: NodeIdentity,
    gpus: Mapping[int, GpuInfo],
    *,
    refused: Mapping[str, str],
    mps_available: bool,
) -> list[PlannedDevice]:
    """The claim's devices of this driver, in allocation order; ClaimError for the first
    problem. `refused`: GPU UUID -> why the node refuses it."""
    ours = claim.results_for(node.driver_name)
    if not ours:
        raise ClaimError(
            "no-results",
            f"no device is allocated by driver {node.driver_name} "
            f"(allocated: {describe_results(claim.results)})",
        )
    plan: list[PlannedDevice] = []
    used: dict[str, list[Placement | None]] = {}
    for r in ours:
        gpu, profile, placement = _locate(r, node, gpus, refused)
        for other in used.get(gpu.uuid, ()):
            if other is None or placement is None or other.overlaps(placement):
                raise ClaimError(
                    "conflicting-devices",
                    f"device {r.device!r} overlaps another device of the same claim",
                )
        used.setdefault(gpu.uuid, []).append(placement)
        try:
            cfg = resolve_config(claim.config, node.driver_name, r.request)
        except ConfigError as e:
            raise ClaimError("bad-config", f"invalid opaque config: {e}") from e
        mps = cfg.sharing.mps if cfg.sharing.strategy is SharingStrategy.MPS else None
        if mps is not None:
            check_mps(r.device, gpu, profile, mps, available=mps_available)
        plan.append(PlannedDevice(r, gpu, profile, placement, cfg.container_env(), mps))
    configs = {p.mps for p in plan if p.mps is not None}
    if len(configs) > 1:
        raise ClaimError(
            "mps-config",
            "the claim's requests ask for different MPS settings; one MPS control daemon "
            "serves a claim, so give its requests one mpsConfig",
        )
    return plan


def _locate(
    r: AllocatedDevice,
    node: NodeIdentity,
    gpus: Mapping[int, GpuInfo],
    refused: Mapping[str, str],
) -> tuple[GpuInfo, ProfileSpec | None, Placement | None]:
    """The GPU, profile and placement a device name names on this node."""
    if r.pool != node.pool_name:
        raise ClaimError(
            "wrong-node",
            f"device {r.device} is allocated from pool {r.pool!r}, but this is node "
            f"{node.node_name!r} (pool {node.pool_name!r})",
        )
    if r.admin_access:
        raise ClaimError("admin-access", f"device {r.device}: adminAccess is not supported")
    try:
        parsed = parse_device_name(r.device)
    except ValueError:
        parsed = None
    gpu = gpus.get(parsed.minor) if parsed else None
    if parsed is None or gpu is None:
        raise ClaimError(
            "unknown-device",
            f"device {r.device!r} (request {r.request}) is not a device of this node "
            f"(GPUs: {', '.join(f'gpu-{m}' for m in sorted(gpus))})",
        )
    profile_id, start = parsed.profile_id, parsed.placement_start
    if gpu.uuid in refused:
        place = None if profile_id is None or start is None else (profile_id, start)
        raise GpuRefusedError(f"{gpu_label(gpu)} is refused: {refused[gpu.uuid]}", gpu.uuid, place)
    if profile_id is None:
        return gpu, None, None
    profile = gpu.profile(profile_id)
    placement = (
        next((pl for pl in profile.placements if pl.start == start), None) if profile else None
    )
    if profile is None or placement is None:
        raise ClaimError(
            "unknown-device",
            f"device {r.device!r}: {gpu_label(gpu)} has no MIG profile id {profile_id} "
            f"with a placement starting at {start}",
        )
    return gpu, profile, placement


def check_mps(
    device: str, gpu: GpuInfo, profile: ProfileSpec | None, mps: MpsConfig, *, available: bool
) -> None:
    """MPS settings the node cannot apply, refused before anything is carved. A whole GPU
    takes MPS as a slice does: its daemon serves the GPU, and a pinned-memory limit may be
    at most what the device has (the GPU's memory, or the slice's)."""
    limit = mps.default_pinned_device_memory_limit_bytes
    if profile is None:
        memory_mib = gpu.memory_mib
        what = f"the memory of {gpu_label(gpu)} ({memory_mib}Mi)"
    else:
        memory_mib = profile.memory_mib
        what = f"the {profile.name} slice's memory ({memory_mib}Mi)"
    if limit is not None and limit > memory_mib * 2**20:
        raise ClaimError(
            "mps-config",
            f"device {device}: mpsConfig.defaultPinnedDeviceMemoryLimit {limit // 2**20}Mi "
            f"is more than {what}",
        )
    if not available:
        raise ClaimError(
            "mps-unavailable",
            f"device {device}: MPS sharing asked for, but this node's plugin has no "
            "nvidia-cuda-mps-control (not in the driver root, or no --driver-root given)",
        )
