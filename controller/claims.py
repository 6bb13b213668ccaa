"""Typed, validated views of DeviceClasses and ResourceClaim specs.

The engine never touches API dicts: a claim is parsed once into frozen values, and anything the
controller cannot honour (a malformed count, an unknown constraint, adminAccess) is refused here
with a message naming the field, so the reconciler can put it on the claim and pod as an event
and carry on with other pods (invariant 5).

Input is what the API serves (camelCase keys), e.g. ``ApiClient().sanitize_for_serialization``
of a typed object or a dynamic-client dict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from controller.tolerations import Toleration, TolerationError, parse_tolerations
from driver.allocation import AllocatedDevice, AllocationFormatError, parse_allocation
from driver.cel import qualify
from driver.config import ConfigError, parse_parameters
from driver.contract import DEFAULT_DRIVER_NAME
from driver.quantity import parse_quantity

MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_SELECTORS = 32
MAX_CONSTRAINTS = 32
MAX_CONFIGS = 32

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# The resource.k8s.io/v1 fields carve reads, per object. A field outside these is refused by name
# rather than ignored: an allocation that ignored it would not be what the user asked for.
_EXACT_FIELDS = frozenset(
    {"deviceClassName", "selectors", "allocationMode", "count", "adminAccess", "tolerations"}
    | {"capacity"}
)
_SUBREQUEST_FIELDS = (_EXACT_FIELDS - {"adminAccess"}) | {"name"}
_REQUEST_FIELDS = frozenset({"name", "exactly", "firstAvailable"})
_DEVICES_FIELDS = frozenset({"requests", "constraints", "config"})
_CONSTRAINT_FIELDS = frozenset({"requests", "matchAttribute", "distinctAttribute"})
_CONFIG_FIELDS = frozenset({"requests", "opaque"})
_OPAQUE_FIELDS = frozenset({"driver", "parameters"})
_CLASS_FIELDS = frozenset({"selectors", "config", "extendedResourceName"})
_QUALIFIED = re.compile(r"^(?:[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?/)?[A-Za-z_][A-Za-z0-9_]{0,31}$")


class ClaimSpecError(ValueError):
    """A claim or class the controller cannot allocate as written; the message names the field."""


class AllocationMode(StrEnum):
    EXACT_COUNT = "ExactCount"
    ALL = "All"


class ConstraintKind(StrEnum):
    MATCH = "matchAttribute"
    DISTINCT = "distinctAttribute"


@dataclass(frozen=True)
class OpaqueConfig:
    """Opaque driver parameters, kept as canonical JSON so the value stays hashable."""

    driver: str
    parameters_json: str

    @property
    def parameters(self) -> Any:
        return json.loads(self.parameters_json)


@dataclass(frozen=True)
class DeviceConfig:
    requests: tuple[str, ...]  # empty: applies to every request
    opaque: OpaqueConfig


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...]
    config: tuple[DeviceConfig, ...] = ()


@dataclass(frozen=True)
class ExactRequest:
    """What one (sub)request asks for; hashable so the engine can cache per request shape."""

    device_class: str
    selectors: tuple[str, ...] = ()
    mode: AllocationMode = AllocationMode.EXACT_COUNT
    count: int = 1
    capacity: tuple[tuple[str, Decimal], ...] = ()  # fully qualified name -> minimum
    tolerations: tuple[Toleration, ...] = ()  # of device taints (controller.tolerations)


@dataclass(frozen=True)
class Alternative:
    """One way to satisfy a request: the request itself, or one of its firstAvailable entries.

    ``result_name`` is what ``status.allocation.devices.results[].request`` must say.
    """

    result_name: str
    spec: ExactRequest


@dataclass(frozen=True)
class DeviceRequest:
    name: str
    alternatives: tuple[Alternative, ...]  # in order of preference; one for `exactly`

    @property
    def uses_first_available(self) -> bool:
        return self.alternatives[0].result_name != self.name


@dataclass(frozen=True)
class DeviceConstraint:
    requests: tuple[str, ...]  # empty: every request of the claim
    kind: ConstraintKind
    attribute: str  # fully qualified

    def applies_to(self, request: str) -> bool:
        return not self.requests or request in self.requests


@dataclass(frozen=True)
class ClaimSpec:
    requests: tuple[DeviceRequest, ...]
    constraints: tuple[DeviceConstraint, ...] = ()
    config: tuple[DeviceConfig, ...] = ()

    def device_classes(self) -> Iterator[str]:
        for r in self.requests:
            for a in r.alternatives:
                yield a.spec.device_class


# ---------------------------------------------------------------------------------------------
# Parsing


def _list(value: object, where: str, limit: int) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ClaimSpecError(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > limit:
        raise ClaimSpecError(f"{where}: {len(value)} entries, at most {limit} are allowed")
    return value


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimSpecError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _only(entry: Mapping[str, Any], where: str, known: frozenset[str]) -> None:
    unknown = sorted(k for k, v in entry.items() if k not in known and v is not None)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ClaimSpecError(
            f"{prefix}{unknown[0]}: carve does not support this field "
            f"(it reads {', '.join(sorted(known))}); remove it or use another driver"
        )


def _selectors(value: object, where: str) -> tuple[str, ...]:
    out = []
    for i, s in enumerate(_list(value, where, MAX_SELECTORS)):
        selector = _mapping(s, f"{where}[{i}]")
        _only(selector, f"{where}[{i}]", frozenset({"cel"}))
        expr = _mapping(selector.get("cel"), f"{where}[{i}].cel").get("expression")
        if not isinstance(expr, str) or not expr.strip():
            raise ClaimSpecError(f"{where}[{i}].cel.expression: must be a non-empty string")
        out.append(expr)
    return tuple(out)


def _config(value: object, where: str, carve_driver: str) -> tuple[DeviceConfig, ...]:
    """Config entries; carve's own opaque parameters are validated here, before anything is
    allocated, with the same rules the node applies when it prepares the claim."""
    out = []
    for i, c in enumerate(_list(value, where, MAX_CONFIGS)):
        entry = _mapping(c, f"{where}[{i}]")
        _only(entry, f"{where}[{i}]", _CONFIG_FIELDS)
        opaque = entry.get("opaque")
        if opaque is None:
            raise ClaimSpecError(f"{where}[{i}].opaque: required (the only config kind)")
        opaque = _mapping(opaque, f"{where}[{i}].opaque")
        _only(opaque, f"{where}[{i}].opaque", _OPAQUE_FIELDS)
        driver = opaque.get("driver")
        if not isinstance(driver, str) or not driver:
            raise ClaimSpecError(f"{where}[{i}].opaque.driver: required")
        if driver == carve_driver:
            try:
                parse_parameters(opaque.get("parameters"), f"{where}[{i}].opaque.parameters")
            except ConfigError as exc:
                raise ClaimSpecError(str(exc)) from exc
        params = json.dumps(opaque.get("parameters"), sort_keys=True, separators=(",", ":"))
        requests = tuple(str(r) for r in _list(entry.get("requests"), f"{where}[{i}].requests", 32))
        out.append(DeviceConfig(requests, OpaqueConfig(driver, params)))
    return tuple(out)


def parse_device_class(obj: Mapping[str, Any], driver: str = DEFAULT_DRIVER_NAME) -> DeviceClass:
    """A DeviceClass object (metadata + spec); `driver` is carve's, whose config is validated."""
    name = _mapping(obj.get("metadata"), "metadata").get("name")
    if not isinstance(name, str) or not name:
        raise ClaimSpecError("metadata.name: a DeviceClass needs a name")
    spec = _mapping(obj.get("spec"), "spec")
    _only(spec, "spec", _CLASS_FIELDS)
    return DeviceClass(
        name,
        _selectors(spec.get("selectors"), "spec.selectors"),
        _config(spec.get("config"), "spec.config", driver),
    )


def _exact(
    entry: Mapping[str, Any], where: str, driver: str, known: frozenset[str] = _EXACT_FIELDS
) -> ExactRequest:
    _only(entry, where, known)
    cls = entry.get("deviceClassName")
    if not isinstance(cls, str) or not cls:
        raise ClaimSpecError(f"{where}.deviceClassName: required")
    if entry.get("adminAccess"):
        raise ClaimSpecError(
            f"{where}.adminAccess: admin access is not supported by the carve controller "
            "(it would hand out MIG slices without reserving them)"
        )
    mode_text = entry.get("allocationMode") or AllocationMode.EXACT_COUNT.value
    try:
        mode = AllocationMode(mode_text)
    except ValueError as exc:
        raise ClaimSpecError(
            f"{where}.allocationMode: {mode_text!r} is not ExactCount or All"
        ) from exc
    count = entry.get("count")
    if mode is AllocationMode.ALL:
        if count not in (None, 0):
            raise ClaimSpecError(f"{where}.count: must be unset when allocationMode is All")
        count = 0
    else:
        count = 1 if count is None else count
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ClaimSpecError(f"{where}.count: must be a positive integer, got {count!r}")
        if count > MAX_REQUESTS:
            raise ClaimSpecError(f"{where}.count: {count} exceeds the limit of {MAX_REQUESTS}")
    capacity = []
    capacity_entry = _mapping(entry.get("capacity"), f"{where}.capacity")
    _only(capacity_entry, f"{where}.capacity", frozenset({"requests"}))
    requests = _mapping(capacity_entry.get("requests"), f"{where}.capacity.requests")
    for name, amount in sorted(requests.items()):
        try:
            capacity.append((qualify(driver, name), parse_quantity(str(amount))))
        except ValueError as exc:
            raise ClaimSpecError(f"{where}.capacity.requests[{name}]: {exc}") from exc
    try:
        tolerations = parse_tolerations(entry.get("tolerations"), f"{where}.tolerations")
    except TolerationError as exc:
        raise ClaimSpecError(str(exc)) from exc
    return ExactRequest(
        device_class=cls,
        selectors=_selectors(entry.get("selectors"), f"{where}.selectors"),
        mode=mode,
        count=count,
        capacity=tuple(capacity),
        tolerations=tolerations,
    )


def _request(entry: Mapping[str, Any], where: str, driver: str) -> DeviceRequest:
    _only(entry, where, _REQUEST_FIELDS)
    name = entry.get("name")
    if not isinstance(name, str) or not _DNS_LABEL.match(name):
        raise ClaimSpecError(f"{where}.name: {name!r} is not a DNS label")
    exactly, first = entry.get("exactly"), entry.get("firstAvailable")
    if (exactly is None) == (first is None):
        raise ClaimSpecError(f"{where}: exactly one of exactly or firstAvailable is required")
    if exactly is not None:
        spec = _exact(_mapping(exactly, f"{where}.exactly"), f"{where}.exactly", driver)
        return DeviceRequest(name, (Alternative(name, spec),))
    alternatives = []
    seen: set[str] = set()
    subs = _list(first, f"{where}.firstAvailable", MAX_SUBREQUESTS)
    if not subs:
        raise ClaimSpecError(f"{where}.firstAvailable: must list at least one subrequest")
    for i, raw_sub in enumerate(subs):
        sw = f"{where}.firstAvailable[{i}]"
        sub = _mapping(raw_sub, sw)
        sub_name = sub.get("name")
        if not isinstance(sub_name, str) or not _DNS_LABEL.match(sub_name):
            raise ClaimSpecError(f"{sw}.name: {sub_name!r} is not a DNS label")
        if sub_name in seen:
            raise ClaimSpecError(f"{sw}.name: duplicate subrequest name {sub_name!r}")
        seen.add(sub_name)
        alternatives.append(
            Alternative(f"{name}/{sub_name}", _exact(sub, sw, driver, _SUBREQUEST_FIELDS))
        )
    return DeviceRequest(name, tuple(alternatives))


def parse_claim_spec(spec: Mapping[str, Any], driver: str) -> ClaimSpec:
    """A ResourceClaim's ``spec`` (or a template's ``spec.spec``)."""
    devices = _mapping(_mapping(spec, "spec").get("devices"), "spec.devices")
    _only(devices, "spec.devices", _DEVICES_FIELDS)
    requests = []
    names: set[str] = set()
    raw = _list(devices.get("requests"), "spec.devices.requests", MAX_REQUESTS)
    if not raw:
        raise ClaimSpecError("spec.devices.requests: the claim requests no devices")
    for i, r in enumerate(raw):
        where = f"spec.devices.requests[{i}]"
        req = _request(_mapping(r, where), where, driver)
        if req.name in names:
            raise ClaimSpecError(f"{where}.name: duplicate request name {req.name!r}")
        names.add(req.name)
        requests.append(req)
    constraints = []
    for i, c in enumerate(_list(devices.get("constraints"), "spec.devices.constraints", 32)):
        where = f"spec.devices.constraints[{i}]"
        entry = _mapping(c, where)
        _only(entry, where, _CONSTRAINT_FIELDS)
        kinds = [k for k in ConstraintKind if entry.get(k.value) is not None]
        if len(kinds) != 1:
            raise ClaimSpecError(
                f"{where}: exactly one of matchAttribute or distinctAttribute is required"
            )
        attribute = entry[kinds[0].value]
        if (
            not isinstance(attribute, str)
            or "/" not in attribute
            or not _QUALIFIED.match(attribute)
        ):
            raise ClaimSpecError(
                f"{where}.{kinds[0].value}: {attribute!r} must be a fully qualified attribute "
                f"name such as {driver}/parentUUID"
            )
        listed = tuple(str(n) for n in _list(entry.get("requests"), f"{where}.requests", 32))
        for n in listed:
            if n.split("/", 1)[0] not in names:
                raise ClaimSpecError(f"{where}.requests: {n!r} is not a request of this claim")
        constraints.append(DeviceConstraint(listed, kinds[0], attribute))
    config = _config(devices.get("config"), "spec.devices.config", driver)
    for i, c in enumerate(config):
        for n in c.requests:
            if n.split("/", 1)[0] not in names:
                raise ClaimSpecError(
                    f"spec.devices.config[{i}].requests: {n!r} is not a request of this claim"
                )
    return ClaimSpec(tuple(requests), tuple(constraints), config)


# ---------------------------------------------------------------------------------------------
# Allocations already recorded on claims


@dataclass(frozen=True, order=True)
class ClaimKey:
    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ClaimHold:
    """Devices a claim holds. Busy from allocation until the node confirms destruction
    (invariant 4): a claim stays here while ``status.allocation`` is set, even when the claim
    is terminating, because the controller clears the allocation only after the node's
    finalizer is gone."""

    claim: ClaimKey
    node: str | None
    devices: tuple[AllocatedDevice, ...]


def parse_claim_hold(claim: Mapping[str, Any], driver: str) -> ClaimHold | None:
    """The devices of ``driver`` a ResourceClaim object holds, or None if it holds none.

    The node comes from the allocation's nodeSelector (``metadata.name`` field or the
    ``kubernetes.io/hostname`` label) when it pins exactly one node.
    """
    meta = _mapping(claim.get("metadata"), "metadata")
    try:
        allocation = parse_allocation(_mapping(claim.get("status"), "status").get("allocation"))
    except AllocationFormatError as exc:
        raise ClaimSpecError(str(exc)) from exc
    devices = tuple(sorted(allocation.results_for(driver), key=AllocatedDevice.sort_key))
    if not devices:
        return None
    key = ClaimKey(
        str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
    )
    return ClaimHold(key, allocation.node, devices)
