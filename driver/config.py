"""Opaque device configuration carried in claims and DeviceClasses.

Users put `config[].opaque.parameters` on a ResourceClaim or a DeviceClass with `driver:` set to
carve's driver name (`mig.carve.dev` by default). The apiserver stores the parameters without
looking at them, so this module is the only validator: unknown fields and bad values are errors
that name the field and say what is allowed, because a silently ignored typo would give the pod a
different device setup than the user asked for.

Precedence: configs from the class apply first, then configs from the claim, each in list order;
the last matching entry wins. A claim can therefore override its class.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from driver.contract import CONFIG_API_GROUP

API_VERSION = f"{CONFIG_API_GROUP}/v1alpha1"
KIND_MIG_DEVICE_CONFIG = "MigDeviceConfig"

_QUANTITY_RE = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_QUANTITY_FACTORS = {
    None: 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


class ConfigError(ValueError):
    """Opaque parameters that carve cannot apply; the message names the offending field."""


class SharingStrategy(StrEnum):
    NONE = "None"
    TIME_SLICING = "TimeSlicing"
    MPS = "MPS"


class TimeSliceInterval(StrEnum):
    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


@dataclass(frozen=True)
class TimeSlicingConfig:
    interval: TimeSliceInterval = TimeSliceInterval.DEFAULT


@dataclass(frozen=True)
class MpsConfig:
    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit_bytes: int | None = None


@dataclass(frozen=True)
class Sharing:
    strategy: SharingStrategy = SharingStrategy.NONE
    time_slicing: TimeSlicingConfig | None = None
    mps: MpsConfig | None = None


@dataclass(frozen=True)
class MigDeviceConfig:
    sharing: Sharing = Sharing()

    def container_env(self) -> dict[str, str]:
        """The environment this config adds to every container that gets the device.

        The sharing strategy is exported so that workloads can see what the operator asked
        for. MPS limits are not: the plugin's MPS control daemon applies them as its defaults,
        and a container's own ``CUDA_MPS_*`` limits (per client, see ``driver.mpsclient``)
        must not be overwritten by a CDI edit of the same name.
        """
        env = {"CARVE_SHARING_STRATEGY": self.sharing.strategy.value}
        ts = self.sharing.time_slicing
        if self.sharing.strategy is SharingStrategy.TIME_SLICING and ts is not None:
            env["CARVE_TIME_SLICE_INTERVAL"] = ts.interval.value
        return env


DEFAULT_CONFIG = MigDeviceConfig()


def _fields(where: str, obj: Any, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected an object, got {type(obj).__name__}")
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(map(repr, extra))}; "
            f"allowed: {', '.join(allowed)}"
        )
    return obj


def _enum(where: str, value: Any, enum: type[StrEnum]) -> Any:
    allowed = [m.value for m in enum]
    if value not in allowed:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
    return enum(value)


def _byte_quantity(where: str, value: Any) -> int:
    """A byte count a user wrote, such as `10Gi` or `512M`: whole numbers with a byte suffix
    only, unlike the API quantities `driver.quantity.parse_quantity` reads back."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _QUANTITY_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{where}: {value!r} is not a byte quantity such as 10Gi or 512Mi")
    return int(m.group(1)) * _QUANTITY_FACTORS[m.group(2)]


def _parse_mps(where: str, obj: Any) -> MpsConfig:
    f = _fields(where, obj, ["defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit"])
    pct = f.get("defaultActiveThreadPercentage")
    if pct is not None and (
        not isinstance(pct, int) or isinstance(pct, bool) or not 1 <= pct <= 100
    ):
        raise ConfigError(
            f"{where}.defaultActiveThreadPercentage: must be an integer from 1 to 100, got {pct!r}"
        )
    limit = f.get("defaultPinnedDeviceMemoryLimit")
    return MpsConfig(
        default_active_thread_percentage=pct,
        default_pinned_device_memory_limit_bytes=(
            None
            if limit is None
            else _byte_quantity(f"{where}.defaultPinnedDeviceMemoryLimit", limit)
        ),
    )


def _parse_sharing(where: str, obj: Any) -> Sharing:
    f = _fields(where, obj, ["strategy", "timeSlicingConfig", "mpsConfig"])
    strategy = _enum(f"{where}.strategy", f.get("strategy", "None"), SharingStrategy)
    ts_raw, mps_raw = f.get("timeSlicingConfig"), f.get("mpsConfig")
    if ts_raw is not None and strategy is not SharingStrategy.TIME_SLICING:
        raise ConfigError(f"{where}.timeSlicingConfig: only valid with strategy TimeSlicing")
    if mps_raw is not None and strategy is not SharingStrategy.MPS:
        raise ConfigError(f"{where}.mpsConfig: only valid with strategy MPS")
    ts = None
    if strategy is SharingStrategy.TIME_SLICING:
        tf = _fields(f"{where}.timeSlicingConfig", ts_raw or {}, ["interval"])
        ts = TimeSlicingConfig(
            _enum(
                f"{where}.timeSlicingConfig.interval",
                tf.get("interval", "Default"),
                TimeSliceInterval,
            )
        )
    mps = (
        _parse_mps(f"{where}.mpsConfig", mps_raw or {}) if strategy is SharingStrategy.MPS else None
    )
    return Sharing(strategy, ts, mps)


def parse_parameters(parameters: Any, where: str = "parameters") -> MigDeviceConfig:
    """Parse one `opaque.parameters` object into a validated config."""
    f = _fields(where, parameters, ["apiVersion", "kind", "sharing"])
    if f.get("apiVersion") != API_VERSION:
        raise ConfigError(
            f"{where}.apiVersion: {f.get('apiVersion')!r} is not supported; use {API_VERSION}"
        )
    if f.get("kind") != KIND_MIG_DEVICE_CONFIG:
        raise ConfigError(
            f"{where}.kind: {f.get('kind')!r} is not supported; use {KIND_MIG_DEVICE_CONFIG}"
        )
    sharing = _parse_sharing(f"{where}.sharing", f["sharing"]) if "sharing" in f else Sharing()
    return MigDeviceConfig(sharing)


@dataclass(frozen=True)
class OpaqueConfigEntry:
    """One `config[]` entry of a claim's allocation (or spec), reduced to what carve reads."""

    source: str  # "FromClass" or "FromClaim"
    requests: tuple[str, ...]  # empty: applies to every request
    driver: str
    parameters: Any

    def applies_to(self, request: str) -> bool:
        # A result for a subrequest ("main/sub") is also configured by entries naming "main".
        return (
            not self.requests
            or request in self.requests
            or (request.partition("/")[0] in self.requests)
        )


def resolve_config(
    entries: Sequence[OpaqueConfigEntry], driver: str, request: str
) -> MigDeviceConfig:
    """The effective config of one request: class entries, then claim entries; last wins.

    Every entry for this driver is parsed (and must be valid) even if a later one overrides it,
    so a broken entry is reported rather than hidden by luck of ordering.
    """
    ordered = sorted(enumerate(entries), key=lambda ie: ie[1].source != "FromClass")
    chosen = DEFAULT_CONFIG
    for i, entry in ordered:
        if entry.driver != driver or not entry.applies_to(request):
            continue
        where = f"config[{i}] ({entry.source}).opaque.parameters"
        chosen = parse_parameters(entry.parameters, where)
    return chosen
