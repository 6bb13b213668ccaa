"""MIG instances carve did not create, and what the node publishes while they exist.

An admin's `nvidia-smi mig -cgi`, mig-parted or another driver can create a MIG instance on a
GPU carve manages, at any time. Such a *foreign* instance blocks the placements it overlaps
(and, through the engine pools and instance limits, sometimes others), but the controller
cannot see it: it only reads ResourceSlices. So the node says so in them. Every device the
foreign instances make impossible to carve gets the taint `<driver>/foreign-instance`:

* `NoSchedule` on each blocked device, so that neither carve's controller nor kube-scheduler
  hands it out (a claim that tolerates the taint is still refused by the node);
* `NoExecute` on a blocked device that a claim was already allocated and whose prepare the node
  refused because of the instance ("stuck"): kube-controller-manager's device-taint eviction
  then deletes the pod that would otherwise sit in ContainerCreating for good, and its
  controller (Deployment, Job, ...) gets a replacement that carve places elsewhere.

By policy (`--foreign-instances`): `adopt` leaves the device that matches the instance exactly
untainted, because a claim allocated that device takes the instance over; `leave` taints every
blocked device; `refuse-gpu` taints every device of the GPU, the whole-GPU device included.
A whole-GPU device is blocked by any instance (a whole GPU needs MIG mode off).

This module is pure: the plugin finds the instances (kubeletplugin.prepare) and feeds them here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from driver.catalog import GpuModel
from driver.geometry import PlacementError, geometry_for
from driver.naming import DevicePlace
from driver.nvml.types import GpuInfo
from kubeletplugin.checkpoint import ForeignInstance

Taint = Mapping[str, str]


class ForeignPolicy(StrEnum):
    """What to do with MIG instances that carve finds but did not create."""

    ADOPT = "adopt"  # a claim allocated exactly that profile and placement takes it over
    LEAVE = "leave"  # keep it; its placement stays unusable for carve
    REFUSE_GPU = "refuse-gpu"  # keep it, and refuse every claim on that GPU


WHOLE_GPU: DevicePlace | None = None
"""The key of the whole-GPU device among the places a prepare was refused on (`stuck`)."""


@dataclass(frozen=True)
class ForeignTaints:
    """The taints one GPU's devices carry because of foreign instances."""

    devices: Mapping[DevicePlace, tuple[Taint, ...]] = field(default_factory=dict)
    whole: tuple[Taint, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.devices or self.whole)


def blocked_places(
    model: GpuModel, foreign: Sequence[ForeignInstance]
) -> Mapping[DevicePlace, tuple[int, ...]]:
    """MIG devices of the GPU that cannot be carved while `foreign` exist, each with the GI ids
    that block it (all of them when only their combination does, e.g. through an engine pool).

    An instance the GPU's geometry does not know (a profile NVML offers but the model lacks)
    blocks every device: better offer nothing than a device whose carve must fail."""
    if not foreign:
        return {}
    geometry = geometry_for(model)
    everything = [(p.id, s) for p in model.profiles for s in p.starts]
    all_ids = tuple(sorted(f.gi_id for f in foreign))
    try:
        together = geometry.state_of((f.profile_id, f.placement_start) for f in foreign)
        alone = {f.gi_id: geometry.state_of([(f.profile_id, f.placement_start)]) for f in foreign}
    except (PlacementError, KeyError, ValueError):
        return {place: all_ids for place in everything}
    out: dict[DevicePlace, tuple[int, ...]] = {}
    for pid, start in everything:
        if geometry.fits(together, pid, start):
            continue
        by = tuple(
            gi for gi, state in sorted(alone.items()) if not geometry.fits(state, pid, start)
        )
        out[(pid, start)] = by or all_ids
    return out


def foreign_taints(
    model: GpuModel,
    foreign: Sequence[ForeignInstance],
    *,
    policy: ForeignPolicy,
    key: str,
    stuck: Collection[DevicePlace | None] = (),
) -> ForeignTaints:
    """The taints of one GPU's devices (see the module docstring); `stuck` are the places (and
    `WHOLE_GPU`) a prepare was refused on because of these instances."""
    if not foreign:
        return ForeignTaints()
    blocked = dict(blocked_places(model, foreign))
    all_ids = tuple(sorted(f.gi_id for f in foreign))
    if policy is ForeignPolicy.REFUSE_GPU:
        blocked = {(p.id, s): all_ids for p in model.profiles for s in p.starts}
    elif policy is ForeignPolicy.ADOPT:
        for f in foreign:
            blocked.pop((f.profile_id, f.placement_start), None)

    def taint(place: DevicePlace | None, ids: tuple[int, ...]) -> tuple[Taint, ...]:
        effect = "NoExecute" if place in stuck else "NoSchedule"
        return ({"key": key, "value": _value(ids), "effect": effect},)

    return ForeignTaints(
        devices={place: taint(place, ids) for place, ids in blocked.items()},
        whole=taint(WHOLE_GPU, all_ids),
    )


def _value(gi_ids: tuple[int, ...]) -> str:
    """The taint's value names the blocking GPU instances, within a label value's 63 chars."""
    text = ".".join(f"gi-{i}" for i in gi_ids)
    return text if len(text) <= 63 else text[:63].rstrip(".-")


def describe(f: ForeignInstance, gpu: GpuInfo) -> str:
    """One instance as an operator reads it in an event or a refusal."""
    profile = gpu.profile(f.profile_id)
    end = f.placement_start + f.placement_size - 1
    span = (
        f"memory slice {f.placement_start}"
        if f.placement_size == 1
        else f"memory slices {f.placement_start}-{end}"
    )
    name = profile.name if profile else f"profile id {f.profile_id}"
    return f"GI {f.gi_id} ({name}, {span})"
