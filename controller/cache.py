"""What the controller keeps of each API object it watches, so memory follows carve's share of
the cluster rather than the cluster.

- Pods: a pod that neither names a ResourceClaim nor carries carve's gate matters only once it
  is bound (its CPU, memory and pod slot count against its node's fit), and then only through
  its requests: such pods are kept as a small projection, and not at all while unbound or after
  they end. Pods that use claims, or carry the gate, are kept whole (the reconciler writes to
  them and reads their claims, conditions and containers).
- ResourceSlices: kept whole (the placement engine re-reads a node's whole pool when one slice
  changes, and the usage gauges read the counters), but with their small containers shared: the
  plugin publishes the same capacity maps, counter consumptions and attribute values for every
  GPU of a model, so a fleet of a few GPU models holds a few thousand distinct ones.
- Every object loses `metadata.managedFields` and the last-applied annotation, which nothing in
  the controller reads.

Objects from the cache are read-only: the interned containers are shared between objects.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from controller.reconciler import is_terminal
from controller.status import has_gate

Obj = dict[str, Any]

_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
_PLAIN_POD_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
_PLAIN_POD_META_OPTIONAL = ("deletionTimestamp",)


def strip_bookkeeping(obj: Obj) -> Obj:
    """The object without what the apiserver and kubectl keep for themselves."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return obj
    meta.pop("managedFields", None)
    annotations = meta.get("annotations")
    if isinstance(annotations, dict) and _LAST_APPLIED in annotations:
        annotations.pop(_LAST_APPLIED)
        if not annotations:
            meta.pop("annotations")
    return obj


def _requests_only(containers: Any, *, init: bool) -> list[Obj]:
    out: list[Obj] = []
    for c in containers or []:
        if not isinstance(c, Mapping):
            continue
        kept: Obj = {"name": c.get("name")}
        requests = (c.get("resources") or {}).get("requests")
        if requests:
            kept["resources"] = {"requests": requests}
        if init and c.get("restartPolicy"):
            kept["restartPolicy"] = c["restartPolicy"]
        out.append(kept)
    return out


def plain_pod(pod: Obj) -> Obj:
    """A bound pod that carve neither places nor releases, as far as node fit reads it
    (`controller.nodefit.pod_requests`, the node binding and the phase)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    kept_meta = {k: meta[k] for k in _PLAIN_POD_META if k in meta}
    kept_meta.update({k: meta[k] for k in _PLAIN_POD_META_OPTIONAL if meta.get(k)})
    kept_spec: Obj = {
        "nodeName": spec.get("nodeName"),
        "containers": _requests_only(spec.get("containers"), init=False),
    }
    if spec.get("initContainers"):
        kept_spec["initContainers"] = _requests_only(spec["initContainers"], init=True)
    for key in ("overhead", "priority"):
        if spec.get(key) is not None:
            kept_spec[key] = spec[key]
    out: Obj = {"metadata": kept_meta, "spec": kept_spec}
    phase = (pod.get("status") or {}).get("phase")
    if phase:
        out["status"] = {"phase": phase}
    if "kind" in pod:
        out["kind"] = pod["kind"]
    return out


def pod_view(gate: str) -> Callable[[Obj], Obj | None]:
    """The pod informer's transform: None for pods the controller does not need at all."""

    def view(pod: Obj) -> Obj | None:
        spec = pod.get("spec") or {}
        if spec.get("resourceClaims") or has_gate(pod, gate):
            return strip_bookkeeping(pod)
        if not spec.get("nodeName") or is_terminal(pod):
            return None
        return plain_pod(pod)

    return view


class Interner:
    """Makes equal small JSON containers (and all strings) one shared object.

    A dict or list is shared when it has at most `max_items` entries and every container in
    it is shared already, so the table holds small keys only; the large per-device and
    per-slice containers stay private and point at shared parts. Entries that no cached
    object uses any more are dropped whenever the table has doubled since the last sweep.
    """

    def __init__(self, max_items: int = 8) -> None:
        self._max = max_items
        self._table: dict[tuple[object, ...], Any] = {}
        self._sweep_at = 4096

    def __len__(self) -> int:
        return len(self._table)

    def __call__(self, obj: Obj) -> Obj:
        value, _ = self._intern(obj)
        if len(self._table) >= self._sweep_at:
            self.sweep()
        result: Obj = value
        return result

    def _intern(self, value: Any) -> tuple[Any, bool]:
        """The (possibly shared) value and whether it is shared (or a scalar)."""
        if isinstance(value, str):
            return sys.intern(value), True
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            shareable = len(value) <= self._max
            for k, raw in value.items():
                v, shared = self._intern(raw)
                out[sys.intern(k) if isinstance(k, str) else k] = v
                shareable = shareable and shared
            if not shareable:
                return out, False
            return self._share(("d", *((k, _token(v)) for k, v in out.items())), out)
        if isinstance(value, list):
            items = []
            shareable = len(value) <= self._max
            for raw in value:
                v, shared = self._intern(raw)
                items.append(v)
                shareable = shareable and shared
            if not shareable:
                return items, False
            return self._share(("l", *(_token(v) for v in items)), items)
        return value, True

    def _share(self, key: tuple[object, ...], value: Any) -> tuple[Any, bool]:
        return self._table.setdefault(key, value), True

    def sweep(self) -> int:
        """Drop entries only the table still holds; returns how many went."""
        dropped = 0
        while True:
            probe: list[int] = []
            self._table[("probe",)] = probe
            del probe
            floor = _refcount(self._table, ("probe",))
            stale = [k for k in self._table if _refcount(self._table, k) <= floor]
            for k in stale:
                del self._table[k]
            dropped += len(stale) - 1  # the probe itself
            if len(stale) <= 1:
                break
        self._sweep_at = max(4096, 2 * len(self._table))
        return dropped


def _refcount(table: Mapping[tuple[object, ...], Any], key: tuple[object, ...]) -> int:
    return sys.getrefcount(table[key])


def _token(value: Any) -> object:
    """What identifies a shared value inside its parent's key: containers by identity (they
    are table entries, alive as long as the parent is), scalars by type and value (so that
    1, 1.0 and True stay apart)."""
    if isinstance(value, dict | list):
        return id(value)
    return (type(value), value)


def slice_view() -> Callable[[Obj], Obj]:
    """The ResourceSlice informer's transform (one interner per informer thread)."""
    interner = Interner()

    def view(obj: Obj) -> Obj:
        return interner(strip_bookkeeping(obj))

    return view
