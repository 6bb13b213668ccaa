"""One allocated device, and the one parser of a ResourceClaim's ``status.allocation``.

The controller writes ``status.allocation``, the node agent prepares what it says, and the dev
tooling checks it against the simulated hardware. All of them read the same API object, so they
share one model of it: a device chosen for a request is an `AllocatedDevice` from the
controller's decision to the prepared device. Only the edges keep their own shapes, because they
carry meaning the API result does not: the node checkpoint's `DeviceRecord` (what is on disk
after a crash) and the gRPC `PreparedDevice` (what the kubelet is told).

Input is what the apiserver serves (camelCase keys). The apiserver validates results, so a
malformed one means a client that is not the apiserver (or a bug); the parser refuses it with an
`AllocationFormatError` that names the field instead of guessing what was meant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from driver.apiobject import Obj
from driver.config import OpaqueConfigEntry

_WHERE = "status.allocation"


class AllocationFormatError(ValueError):
    """A ``status.allocation`` carve cannot read; the message names the field."""


@dataclass(frozen=True)
class AllocatedDevice:
    """One ``status.allocation.devices.results[]`` entry (``request`` is ``<main>`` or
    ``<main>/<sub>``).

    ``tolerations_json`` is the result's tolerations as canonical JSON ("" for none), so that the
    value stays hashable. ``profile`` is not part of the API's result: the controller's planner
    records the catalog profile it chose (e.g. ``3g.40gb``) for metrics and events, where the
    device name alone may not say it; a parsed result has none. It does not take part in
    equality, so a planned device equals the same device read back from the API.
    """

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    tolerations_json: str = ""
    profile: str = field(default="", compare=False)
    # Copied from the published device (kube-scheduler waits in PreBind until every binding
    # condition is True in the claim's status.devices, and gives up on a failure condition).
    binding_conditions: tuple[str, ...] = ()
    binding_failure_conditions: tuple[str, ...] = ()

    @property
    def tolerations(self) -> list[Any]:
        return json.loads(self.tolerations_json) if self.tolerations_json else []

    def sort_key(self) -> tuple[str, str, str, str]:
        """Order by what identifies the device (share IDs may be None, so no dataclass order)."""
        return (self.request, self.driver, self.pool, self.device)


@dataclass(frozen=True)
class Allocation:
    """A parsed ``status.allocation``: every driver's results, the opaque config entries, and the
    node when the nodeSelector pins exactly one."""

    results: tuple[AllocatedDevice, ...]
    config: tuple[OpaqueConfigEntry, ...]
    node: str | None

    def results_for(self, driver: str) -> tuple[AllocatedDevice, ...]:
        return tuple(r for r in self.results if r.driver == driver)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise AllocationFormatError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _list(value: object, where: str) -> list[Any] | tuple[Any, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise AllocationFormatError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise AllocationFormatError(f"{where}.{key} is missing or not a string")
    return value


def parse_result(entry: object, where: str) -> AllocatedDevice:
    """One ``results[]`` entry; `where` names it in errors."""
    r = _mapping(entry, where)
    share_id = r.get("shareID")
    if share_id is not None and not isinstance(share_id, str):
        raise AllocationFormatError(f"{where}.shareID is not a string")
    tolerations = _list(r.get("tolerations"), f"{where}.tolerations")
    binding = _names(r.get("bindingConditions"), f"{where}.bindingConditions")
    failure = _names(r.get("bindingFailureConditions"), f"{where}.bindingFailureConditions")
    return AllocatedDevice(
        request=_str(r, "request", where),
        driver=_str(r, "driver", where),
        pool=_str(r, "pool", where),
        device=_str(r, "device", where),
        admin_access=bool(r.get("adminAccess")),
        share_id=share_id,
        tolerations_json=canonical_json(list(tolerations)) if tolerations else "",
        binding_conditions=binding,
        binding_failure_conditions=failure,
    )


def _names(value: object, where: str) -> tuple[str, ...]:
    items = _list(value, where)
    if not all(isinstance(v, str) for v in items):
        raise AllocationFormatError(f"{where}: expected a list of strings")
    return tuple(items)


def parse_allocation(allocation: object) -> Allocation:
    """A ResourceClaim's ``status.allocation`` (None or empty: nothing allocated).

    Config entries that are not opaque are skipped (carve reads no other kind); an opaque entry
    without a source is a claim's own (``FromClaim``).
    """
    alloc = _mapping(allocation, _WHERE)
    devices = _mapping(alloc.get("devices"), f"{_WHERE}.devices")
    results = tuple(
        parse_result(r, f"{_WHERE}.devices.results[{i}]")
        for i, r in enumerate(_list(devices.get("results"), f"{_WHERE}.devices.results"))
    )
    config: list[OpaqueConfigEntry] = []
    for i, c in enumerate(_list(devices.get("config"), f"{_WHERE}.devices.config")):
        where = f"{_WHERE}.devices.config[{i}]"
        entry = _mapping(c, where)
        opaque = _mapping(entry.get("opaque") or None, f"{where}.opaque")
        if not opaque:
            continue
        config.append(
            OpaqueConfigEntry(
                source=str(entry.get("source", "FromClaim")),
                requests=tuple(_list(entry.get("requests"), f"{where}.requests")),
                driver=str(opaque.get("driver", "")),
                parameters=opaque.get("parameters"),
            )
        )
    return Allocation(results, tuple(config), pinned_node(alloc.get("nodeSelector")))


def pinned_node(selector: object) -> str | None:
    """The one node a nodeSelector pins (a ``metadata.name`` field or the
    ``kubernetes.io/hostname`` label), or None when it names none or several.

    This is carve's one rule for which node an allocated claim is on: the planner counts a
    claim's devices on that node (`Allocation.node`) and node loss frees the claims of a lost
    node by it (`driver.apiviews.ClaimView.node`), so the two always agree. carve and
    kube-scheduler write one term with a ``metadata.name`` field; a selector of several terms
    lets the claim run on any of them, so it is on no one node. Any shape reads as None
    rather than raising: node loss asks of every claim in the store.
    """
    if not isinstance(selector, Mapping):
        return None
    terms = selector.get("nodeSelectorTerms")
    if not isinstance(terms, list | tuple) or len(terms) != 1 or not isinstance(terms[0], Mapping):
        return None
    for group, key in (
        ("matchFields", "metadata.name"),
        ("matchExpressions", "kubernetes.io/hostname"),
    ):
        requirements = terms[0].get(group)
        for r in requirements if isinstance(requirements, list | tuple) else ():
            if not isinstance(r, Mapping) or r.get("key") != key or r.get("operator") != "In":
                continue
            values = r.get("values")
            if isinstance(values, list | tuple) and len(values) == 1:
                return str(values[0])
    return None


def result_json(device: AllocatedDevice) -> Obj:
    """The ``results[]`` entry the API expects for `device` (optional fields only when set)."""
    entry: Obj = {
        "request": device.request,
        "driver": device.driver,
        "pool": device.pool,
        "device": device.device,
    }
    if device.tolerations_json:
        entry["tolerations"] = device.tolerations
    if device.admin_access:
        entry["adminAccess"] = True
    if device.share_id is not None:
        entry["shareID"] = device.share_id
    if device.binding_conditions:
        entry["bindingConditions"] = list(device.binding_conditions)
        entry["bindingFailureConditions"] = list(device.binding_failure_conditions)
    return entry
