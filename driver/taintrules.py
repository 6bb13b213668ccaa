"""DeviceTaintRules (resource.k8s.io/v1, served by default from Kubernetes 1.37): which devices
an admin's rule taints, exactly as kube-scheduler decides it. Pure: the controller applies the
rules when it reads a node's ResourceSlices, and `carve status` shows them, from the same
judgement, so the two never disagree about which devices a rule covers.

kube-scheduler's ResourceSlice tracker (k8s.io/dynamic-resource-allocation
``resourceslice/tracker``) appends each matching rule's taint to a device's own taints before
its allocator sees the device; the allocator then treats the two alike. A rule selects a device
by exact equality of the fields its ``spec.deviceSelector`` sets:

- ``driver``: the slice's ``spec.driver``;
- ``pool``: the slice's ``spec.pool.name`` (carve names a node's pool after the node);
- ``device``: the device's ``name`` (one MIG placement, e.g. ``gpu-0-mig-1g5gb-19-6``, or the
  whole GPU, ``gpu-0``: a rule naming ``gpu-0`` leaves that GPU's MIG placements allocatable,
  for kube-scheduler as for carve).

An empty selector (``deviceSelector: {}``) selects every device of every driver; a rule with no
selector selects none: the API documents both, and the tracker's source (v0.37.2) does both.
`tests/cluster/test_device_taint_rules.py` checks every form but the empty selector and a device
name alone (both would taint other tests' devices), with effects and tolerations, against the
real kube-scheduler (docs/controller.md, "DeviceTaintRules"). The selector has no
CEL field in v1: the v1alpha3 ``deviceClassName`` and ``selectors`` of 1.33 and 1.34 were
removed in 1.35 (the apiserver drops them as unknown fields; kubectl refuses them).

A rule's taint blocks allocation as a device's own taint does (``NoSchedule``, ``NoExecute``;
``None`` and effects unknown to this version are informational, as the API asks consumers to
treat them); ``timeAdded`` and the rule's status (kube-controller-manager's eviction progress)
play no part in placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

KIND = "DeviceTaintRule"


@dataclass(frozen=True)
class TaintRule:
    """One DeviceTaintRule: its name, what its selector sets (None: any), and its taint."""

    name: str
    key: str
    value: str
    effect: str
    driver: str | None = None
    pool: str | None = None
    device: str | None = None

    def selects(self, driver: str, pool: str, device: str) -> bool:
        """Whether the rule taints ``device`` of ``pool`` published by ``driver``."""
        return (
            (self.driver is None or self.driver == driver)
            and (self.pool is None or self.pool == pool)
            and (self.device is None or self.device == device)
        )

    def may_select_pool(self, driver: str, pool: str) -> bool:
        """Whether some device of that pool can be selected (the device name aside)."""
        return (self.driver is None or self.driver == driver) and (
            self.pool is None or self.pool == pool
        )

    @property
    def taint(self) -> str:
        """The taint as Kubernetes prints one: ``key=value:effect`` or ``key:effect``."""
        return (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )

    @property
    def selector(self) -> str:
        """The selector in words, e.g. ``driver=mig.carve.dev, pool=node-a`` or ``every device``."""
        parts = [
            f"{field}={value}"
            for field, value in (
                ("driver", self.driver),
                ("pool", self.pool),
                ("device", self.device),
            )
            if value is not None
        ]
        return ", ".join(parts) or "every device"


def parse_taint_rule(obj: Mapping[str, Any]) -> TaintRule | None:
    """A DeviceTaintRule (API JSON) as a `TaintRule`, or None when it selects no device (no
    ``deviceSelector``) or cannot be read (the apiserver validated it: never trust, never
    crash; a rule carve cannot read is one it cannot honour, and kube-scheduler could not
    either)."""
    meta = obj.get("metadata")
    spec = obj.get("spec")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return None
    selector = spec.get("deviceSelector")
    taint = spec.get("taint")
    name = meta.get("name")
    if not isinstance(selector, Mapping) or not isinstance(taint, Mapping):
        return None
    key, effect = taint.get("key"), taint.get("effect")
    if not isinstance(name, str) or not isinstance(key, str) or not isinstance(effect, str):
        return None
    value = taint.get("value")
    fields = {f: selector.get(f) for f in ("driver", "pool", "device")}
    if any(v is not None and not isinstance(v, str) for v in fields.values()):
        return None
    return TaintRule(
        name,
        key,
        value if isinstance(value, str) else "",
        effect,
        driver=fields["driver"],
        pool=fields["pool"],
        device=fields["device"],
    )


def rules_on(
    rules: Iterable[TaintRule], driver: str, pool: str, device: str
) -> tuple[TaintRule, ...]:
    """The rules that taint one device, by rule name (the order taints are listed in)."""
    return tuple(
        sorted((r for r in rules if r.selects(driver, pool, device)), key=lambda r: r.name)
    )
