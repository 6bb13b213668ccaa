"""Names carve publishes for devices, counter sets and counters (the driver name and every other
name controller and node agree on are in `driver.contract`).

Device names follow the NVIDIA DRA driver's dynamic-MIG scheme so that users and tools moving
between the two recognise them: `gpu-<minor>` for a whole GPU and
`gpu-<minor>-mig-<slug>-<profileId>-<start>` for one MIG placement. A name encodes the profile id
and placement start, so the kubelet plugin can carve exactly what the allocation names without
any other lookup; the slug is only for people reading `kubectl describe`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ParsedDeviceName",
    "counter_set_name",
    "gpu_device_name",
    "is_dns_label",
    "memory_slice_counter",
    "mig_device_name",
    "parse_device_name",
    "profile_slug",
]

_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_NUMBER = r"(0|[1-9][0-9]*)"  # canonical decimal, so a name has exactly one spelling
_GPU_NAME = re.compile(rf"gpu-{_NUMBER}")
_MIG_NAME = re.compile(rf"gpu-{_NUMBER}-mig-([a-z0-9](?:[a-z0-9-]*[a-z0-9])?)-{_NUMBER}-{_NUMBER}")


def is_dns_label(value: str) -> bool:
    """RFC 1123 label: what Kubernetes requires of device, counter set and counter names."""
    return _DNS_LABEL.fullmatch(value) is not None


def profile_slug(profile_name: str) -> str:
    """The name part of a device name: lower case, '.' dropped, '+' -> '-'.

    `1g.10gb+me` -> `1g10gb-me`, `1g.24gb+me.all` -> `1g24gb-meall`, `1g.24gb-me` -> `1g24gb-me`.
    `+me` and `-me` share a slug; device names stay unique because they carry the profile id.
    """
    slug = profile_name.lower().replace(".", "").replace("+", "-")
    if not is_dns_label(slug):
        raise ValueError(f"profile name {profile_name!r} does not give a DNS-label slug ({slug!r})")
    return slug


def _check_label(name: str) -> str:
    if not is_dns_label(name):
        raise ValueError(f"{name!r} is not a DNS label (lower-case alphanumerics and '-', <= 63)")
    return name


def _check_non_negative(**values: int) -> None:
    for what, value in values.items():
        if value < 0:
            raise ValueError(f"{what} must be >= 0, got {value}")


def gpu_device_name(minor: int) -> str:
    """The whole-GPU device of the GPU with device minor `minor`."""
    _check_non_negative(minor=minor)
    return f"gpu-{minor}"


def mig_device_name(minor: int, profile_name: str, profile_id: int, start: int) -> str:
    """The device for `profile_id` at `start` on GPU `minor`, e.g. `gpu-0-mig-1g10gb-19-3`."""
    _check_non_negative(minor=minor, profile_id=profile_id, start=start)
    return _check_label(f"gpu-{minor}-mig-{profile_slug(profile_name)}-{profile_id}-{start}")


def counter_set_name(minor: int) -> str:
    """The counter set of GPU `minor`; identical across GPUs of one model except the minor."""
    _check_non_negative(minor=minor)
    return f"gpu-{minor}-counters"


def memory_slice_counter(unit: int) -> str:
    """The counter that stands for memory unit `unit`; a placement consumes one per unit."""
    _check_non_negative(unit=unit)
    return f"memory-slice-{unit}"


DevicePlace = tuple[int, int]
"""A MIG device's (GPU instance profile id, placement start): what its name encodes besides the
GPU, and what tells one MIG instance's device from the others."""


@dataclass(frozen=True)
class ParsedDeviceName:
    """What a carve device name encodes. MIG fields are None for a whole-GPU device."""

    minor: int
    profile_slug: str | None = None
    profile_id: int | None = None
    placement_start: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.profile_id is not None


def parse_device_name(name: str) -> ParsedDeviceName:
    """Invert `gpu_device_name` / `mig_device_name`; ValueError says what was expected."""
    if m := _GPU_NAME.fullmatch(name):
        return ParsedDeviceName(minor=int(m.group(1)))
    if (m := _MIG_NAME.fullmatch(name)) and is_dns_label(name):
        return ParsedDeviceName(
            minor=int(m.group(1)),
            profile_slug=m.group(2),
            profile_id=int(m.group(3)),
            placement_start=int(m.group(4)),
        )
    raise ValueError(
        f"{name!r} is not a carve device name; expected 'gpu-<minor>' or "
        "'gpu-<minor>-mig-<profile-slug>-<profileId>-<placementStart>' "
        "(e.g. 'gpu-0-mig-1g10gb-19-3')"
    )
