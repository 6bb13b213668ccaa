"""Cluster-wide invariants checked from the outside: what the simulated GPUs hold against what
the API says is allocated (DESIGN.md invariants 1, 2 and 4). Pure functions over snapshots.

- No overlap: no two allocated devices (across all claims) share a memory slice of one GPU,
  and no device is allocated twice.
- No leak: every GPU instance on a node is named by the allocation of some claim on that
  node. Reading the hardware and the claims cannot be one atomic act, so the hardware is read
  between two claim lists; an instance is a leak only if neither list accounts for it. With the
  node-finalizer handshake an allocation outlives its instance, so this is exact in controller
  mode.
- Exact at rest: once nothing runs, every allocated device has its instance and vice versa.

Instances a node's plugin keeps warm (warm slices, docs/kubeletplugin.md) belong to the node,
not to a claim: they count neither as leaks nor as instances without a claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.allocation import AllocatedDevice, parse_allocation
from driver.catalog import GpuModel
from driver.naming import parse_device_name

Obj = Mapping[str, Any]


@dataclass(frozen=True, order=True)
class Slot:
    """One MIG placement on one GPU of one node (whole-GPU allocations have no slot)."""

    node: str
    minor: int
    profile_id: int
    start: int


@dataclass(frozen=True)
class NodeHardware:
    """A node's simulated GPUs: models by minor and live GPU instances."""

    node: str
    models: Mapping[int, GpuModel]
    instances: tuple[Slot, ...]
    warm: frozenset[Slot] = frozenset()  # kept warm by the node's plugin (its checkpoint)

    @property
    def claimed(self) -> tuple[Slot, ...]:
        """The instances that must belong to a claim: all but the warm ones."""
        return tuple(s for s in self.instances if s not in self.warm)


def node_hardware(node: str, models: Sequence[GpuModel], state: Obj) -> NodeHardware:
    """From a simulator state (`StateStore` JSON) and the node's GPU models in config order."""
    by_minor: dict[int, GpuModel] = {}
    slots: list[Slot] = []
    for model, gpu in zip(models, state.get("gpus") or [], strict=True):
        minor = int(gpu["minor"])
        by_minor[minor] = model
        for gi in gpu.get("gis") or []:
            slots.append(Slot(node, minor, int(gi["profile_id"]), int(gi["start"])))
    return NodeHardware(node, by_minor, tuple(sorted(slots)))


@dataclass(frozen=True)
class HeldDevice:
    """A device of the driver under test and the claim (namespace/name) whose allocation names
    it; the claim is what a violation is reported against."""

    claim: str
    allocated: AllocatedDevice

    @property
    def node(self) -> str:
        return self.allocated.pool  # carve's pools are its nodes

    @property
    def device(self) -> str:
        return self.allocated.device


def allocated_devices(claims: Iterable[Obj], driver: str) -> list[HeldDevice]:
    out: list[HeldDevice] = []
    for claim in claims:
        meta = claim.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        allocation = parse_allocation((claim.get("status") or {}).get("allocation"))
        out += [HeldDevice(key, r) for r in allocation.results_for(driver)]
    return out


def _slot_of(dev: HeldDevice) -> Slot | None:
    parsed = parse_device_name(dev.device)
    if parsed.profile_id is None or parsed.placement_start is None:
        return None
    return Slot(dev.node, parsed.minor, parsed.profile_id, parsed.placement_start)


def _units(model: GpuModel, device: str) -> set[int]:
    parsed = parse_device_name(device)
    if parsed.profile_id is None or parsed.placement_start is None:
        return set(range(model.memory_units))
    size = model.profile_by_id(parsed.profile_id).size
    return set(range(parsed.placement_start, parsed.placement_start + size))


def overlaps(devices: Sequence[HeldDevice], hardware: Mapping[str, NodeHardware]) -> list[str]:
    """Violations of "no two live allocations share a memory slice"."""
    problems: list[str] = []
    owner: dict[tuple[str, int, int], HeldDevice] = {}
    seen: dict[tuple[str, str], HeldDevice] = {}
    for dev in devices:
        twice = seen.get((dev.node, dev.device))
        if twice is not None:
            problems.append(
                f"device {dev.node}/{dev.device} allocated to both {twice.claim} and {dev.claim}"
            )
            continue
        seen[(dev.node, dev.device)] = dev
        hw = hardware.get(dev.node)
        if hw is None:
            continue
        minor = parse_device_name(dev.device).minor
        model = hw.models.get(minor)
        if model is None:
            problems.append(f"{dev.claim}: {dev.node} has no GPU with minor {minor}")
            continue
        for unit in sorted(_units(model, dev.device)):
            other = owner.get((dev.node, minor, unit))
            if other is not None:
                problems.append(
                    f"memory slice {unit} of {dev.node}/gpu-{minor} allocated to {other.claim} "
                    f"({other.device}) and {dev.claim} ({dev.device})"
                )
                break
            owner[(dev.node, minor, unit)] = dev
    return problems


def leaks(
    hardware: Mapping[str, NodeHardware],
    before: Sequence[HeldDevice],
    after: Sequence[HeldDevice],
) -> list[str]:
    """GPU instances that no claim in either snapshot (taken around the hardware read) names."""
    named = {s for s in (_slot_of(d) for d in [*before, *after]) if s is not None}
    return [
        f"leaked instance on {slot.node}/gpu-{slot.minor}: profile id {slot.profile_id} at "
        f"placement start {slot.start} belongs to no allocated claim"
        for hw in hardware.values()
        for slot in hw.claimed
        if slot not in named
    ]


def at_rest(hardware: Mapping[str, NodeHardware], devices: Sequence[HeldDevice]) -> list[str]:
    """With nothing in flight, instances and allocated MIG devices must match one to one."""
    wanted = {s for s in (_slot_of(d) for d in devices) if s is not None and s.node in hardware}
    have = {s for hw in hardware.values() for s in hw.claimed}
    problems = [
        f"allocated {s.node}/gpu-{s.minor} profile {s.profile_id}@{s.start} has no instance"
        for s in sorted(wanted - have)
    ]
    problems += [
        f"instance {s.node}/gpu-{s.minor} profile {s.profile_id}@{s.start} has no claim"
        for s in sorted(have - wanted)
    ]
    return problems
