"""DRA device taints and claim tolerations (resource.k8s.io/v1 DeviceTaint, Toleration),
as kube-scheduler applies them: a device with a NoSchedule or NoExecute taint is allocated only
to a request that tolerates it; a taint with effect None affects nothing.

A toleration matches a taint when its key is empty with operator Exists (every taint) or equals
the taint's key; with operator Equal (the default) the values must be equal too, with Exists the
value must be empty; an empty effect matches every effect. `tolerationSeconds` matters only to
eviction, so placement ignores it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

EFFECTS = frozenset({"NoSchedule", "NoExecute", "None"})
_BLOCKING = frozenset({"NoSchedule", "NoExecute"})
_OPERATORS = frozenset({"Exists", "Equal"})
_KEY = re.compile(
    r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
MAX_TOLERATIONS = 16


class TolerationError(ValueError):
    """A toleration the controller cannot apply; the message names the field."""


@dataclass(frozen=True)
class DeviceTaint:
    """A taint on a published device: the node's own (in its ResourceSlice), or one an admin's
    DeviceTaintRule adds (``rule`` names it, so that a refusal can say whom to ask)."""

    key: str
    value: str
    effect: str
    rule: str = ""  # the DeviceTaintRule that puts it there; "" for the slice's own

    def __str__(self) -> str:
        taint = (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )
        return f"{taint} from DeviceTaintRule {self.rule}" if self.rule else taint


class _Taint(Protocol):
    """A device taint or a node taint: what a toleration is matched against."""

    @property
    def key(self) -> str: ...
    @property
    def value(self) -> str: ...
    @property
    def effect(self) -> str: ...


@dataclass(frozen=True)
class Toleration:
    key: str = ""  # "" with operator Exists tolerates every taint
    operator: str = "Equal"  # "Equal" | "Exists"
    value: str = ""
    effect: str = ""  # "" matches every effect

    def tolerates(self, taint: _Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


def blocking(taints: Iterable[DeviceTaint], tolerations: Sequence[Toleration]) -> list[DeviceTaint]:
    """The taints that keep a device from a request with these tolerations."""
    return [
        t
        for t in taints
        if t.effect in _BLOCKING and not any(tol.tolerates(t) for tol in tolerations)
    ]


def parse_taints(raw: object) -> tuple[DeviceTaint, ...]:
    """A published device's `taints` (API JSON); entries that are not taints are skipped, as
    the apiserver validated them already (never trust, never crash)."""
    if not isinstance(raw, list):
        return ()
    out = []
    for t in raw:
        if isinstance(t, Mapping) and isinstance(t.get("key"), str) and t.get("effect") in EFFECTS:
            value = t.get("value")
            out.append(DeviceTaint(t["key"], value if isinstance(value, str) else "", t["effect"]))
    return tuple(out)


def parse_tolerations(raw: object, where: str) -> tuple[Toleration, ...]:
    """A request's `tolerations` (API JSON), checked with messages naming the field."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise TolerationError(f"{where}: must be a list")
    if len(raw) > MAX_TOLERATIONS:
        raise TolerationError(f"{where}: at most {MAX_TOLERATIONS} tolerations, got {len(raw)}")
    out = []
    for i, entry in enumerate(raw):
        field = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise TolerationError(f"{field}: must be an object")
        unknown = set(entry) - {"key", "operator", "value", "effect", "tolerationSeconds"}
        if unknown:
            raise TolerationError(f"{field}: unknown field(s) {sorted(unknown)}")
        key = entry.get("key") or ""
        operator = entry.get("operator") or "Equal"
        value = entry.get("value") or ""
        effect = entry.get("effect") or ""
        if not isinstance(key, str) or (key and not _KEY.match(key)):
            raise TolerationError(
                f"{field}.key: {key!r} is not a label key (e.g. mig.carve.dev/gpu-unhealthy)"
            )
        if operator not in _OPERATORS:
            raise TolerationError(f"{field}.operator: {operator!r} is not Exists or Equal")
        if not key and operator != "Exists":
            raise TolerationError(
                f"{field}.key: a toleration without a key matches every taint and must use "
                "operator Exists; name the taint's key (e.g. mig.carve.dev/gpu-unhealthy)"
            )
        if not isinstance(value, str) or (operator == "Exists" and value):
            raise TolerationError(f"{field}.value: must be empty with operator Exists")
        if effect and effect not in EFFECTS:
            raise TolerationError(
                f"{field}.effect: {effect!r} is not NoSchedule, NoExecute or None "
                "(or empty for all)"
            )
        seconds = entry.get("tolerationSeconds")
        if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool)):
            raise TolerationError(f"{field}.tolerationSeconds: must be an integer")
        out.append(Toleration(key, operator, value, effect))
    return tuple(out)
