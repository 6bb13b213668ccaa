"""What the controller keeps of each API object it watches, so memory follows carve's share of
the cluster rather than the cluster.

- Pods: a pod that neither names a ResourceClaim nor carries carve's gate matters only once it
  is bound (its CPU, memory and pod slot count against its node's fit), and then only through
  its requests: such pods are kept as a small projection, and not at all while unbound or after
  they end. Pods that use claims, or carry the gate, are kept as far as the controller reads
  them (`carve_pod`): the spec's scheduling fields, each container's name, resources and
  MPS client variables, the labels (disruption budgets select by them), carve's own
  annotations, and the status fields the decision reads. A training job's pod is some 13 KB
  once parsed; its env, mounts, probes, volumes and other tools' annotations are most of it.
- ResourceSlices: kept with every value (the placement engine re-reads a node's whole pool when
  one slice changes, and the usage gauges read the counters), but compactly: the plugin
  publishes the same capacity maps, counter consumptions and attribute values for every GPU of
  a model, so those are shared (a fleet of a few GPU models holds a few thousand distinct
  ones), and a slice's devices are packed (`PackedDevices`): their values in one tuple, their
  keys and their attributes' names once per layout. A device dict and its attributes dict cost
  ~650 bytes; a packed device ~140, and a GPU node publishes ~200 devices.
- Nodes: only what node fit and node loss read (`trim_node`): taints, cordon, allocatable,
  conditions; a Node's images, addresses and daemon endpoints are most of its bytes.
- ResourceClaims: only carve's (`claim_view`): a claim of one of carve's DeviceClasses, or one
  whose allocation holds one of carve's devices (a claim of another class that selects
  carve's devices, allocated by kube-scheduler: its devices are busy). Another driver's claims
  are none of carve's business, and ten thousand of them must not grow carve's memory.
- ResourceSlices: carve's driver only, chosen by the apiserver (a `spec.driver` field selector
  in `controller.informers`), so another driver's slices never reach the controller at all.
- Every object loses `metadata.managedFields` and the last-applied annotation, which nothing in
  the controller reads.

Objects from the cache are read-only: the interned containers are shared between objects, and
packed devices are read-only sequences and mappings (`plain_json` gives plain JSON back).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from controller.autoscaling import SAFE_TO_EVICT
from controller.namespaceshare import NamespaceShare
from controller.objects import CarveClasses, is_carve_claim
from controller.work import may_need_work
from driver.apiviews import ClaimView, NodeView, PodView
from driver.mpsclient import VARIABLES as MPS_CLIENT_VARIABLES
from process.kube import Obj

_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
_PLAIN_POD_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
_PLAIN_POD_META_OPTIONAL = ("deletionTimestamp",)
_CARVE_POD_META = (
    *_PLAIN_POD_META,
    *_PLAIN_POD_META_OPTIONAL,
    "generation",
    "labels",
    "ownerReferences",
    "finalizers",
)
# What the controller never reads of a pod's spec (everything else is small and kept).
_UNREAD_POD_SPEC = frozenset(
    {"volumes", "ephemeralContainers", "hostAliases", "dnsConfig", "imagePullSecrets",
     "securityContext", "readinessGates", "os", "resourceClaimsStatus"}
)  # fmt: skip
_CARVE_POD_STATUS = (
    "phase",
    "conditions",
    "startTime",
    "resourceClaimStatuses",
    "extendedResourceClaimStatus",
    "nominatedNodeName",
)


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
    view = PodView(pod)
    meta, spec = view.metadata, view.spec
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
    phase = view.phase
    if phase:
        out["status"] = {"phase": phase}
    if "kind" in pod:
        out["kind"] = pod["kind"]
    return out


def _container_as_read(c: Any, *, init: bool) -> Obj:
    """A container as node fit (requests), extended resources (limits), claims (resources.
    claims) and the MPS check (literal client variables in env) read it."""
    kept: Obj = {"name": c.get("name")}
    if c.get("resources"):
        kept["resources"] = c["resources"]
    if init and c.get("restartPolicy"):
        kept["restartPolicy"] = c["restartPolicy"]
    env = [
        e
        for e in c.get("env") or []
        if isinstance(e, Mapping) and e.get("name") in MPS_CLIENT_VARIABLES and "valueFrom" not in e
    ]
    if env:
        kept["env"] = env
    return kept


def carve_pod(pod: Obj, driver: str) -> Obj:
    """A pod that names a claim or carries carve's gate, as far as the controller reads it
    (the module docstring says what that is); annotations only under `driver`'s domain."""
    view = PodView(pod)
    meta, spec, status = view.metadata, view.spec, view.status
    kept_meta = {k: meta[k] for k in _CARVE_POD_META if meta.get(k)}
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        # Kept even when empty: it says the pod has a map, into which carve may add CA's
        # safe-to-evict (`controller.autoscaling.protection_ops`), whose user's value it keeps.
        kept_meta["annotations"] = {
            k: v
            for k, v in annotations.items()
            if k.partition("/")[0].endswith(driver) or k == SAFE_TO_EVICT
        }
    kept_spec: Obj = {k: v for k, v in spec.items() if k not in _UNREAD_POD_SPEC}
    for field in ("containers", "initContainers"):
        if field in kept_spec:
            kept_spec[field] = [
                _container_as_read(c, init=field == "initContainers")
                for c in kept_spec[field] or []
                if isinstance(c, Mapping)
            ]
    out: Obj = {"metadata": kept_meta, "spec": kept_spec}
    kept_status = {k: status[k] for k in _CARVE_POD_STATUS if status.get(k)}
    if kept_status:
        out["status"] = kept_status
    for key in ("kind", "apiVersion"):
        if key in pod:
            out[key] = pod[key]
    return out


def pod_view(
    gate: str, driver: str, share: NamespaceShare | None = None
) -> Callable[[Obj], Obj | None]:
    """The pod informer's transform: None for pods the controller does not need at all, and
    for waiting pods past their namespace's share (`controller.namespaceshare`)."""

    def view(pod: Obj) -> Obj | None:
        view = PodView(pod)
        if share is not None:
            if may_need_work(pod, gate):
                if not share.admit(pod):
                    return None
            else:
                share.release(f"{view.namespace}/{view.name}")
        if view.spec.get("resourceClaims") or view.has_gate(gate):
            return carve_pod(pod, driver)
        if not view.node_name or view.terminal:
            return None
        return plain_pod(pod)

    return view


def claim_view(
    classes: CarveClasses, driver: str, share: NamespaceShare | None = None
) -> Callable[[Obj], Obj | None]:
    """The claim informer's transform: carve's claims, minus bookkeeping; None for others, and
    for the unallocated claims of pods the namespace share shed."""

    def view(claim: Obj) -> Obj | None:
        if ClaimView(claim).holds_driver(driver):
            return strip_bookkeeping(claim)
        if is_carve_claim(claim, classes):
            if share is not None and share.sheds_claim(claim):
                return None
            return strip_bookkeeping(claim)
        return None

    return view


@dataclass(frozen=True, eq=False)
class _DeviceLayout:
    """The keys of a packed device and of its attributes, held once for every device with the
    same keys in the same order (every device of a GPU model publishes the same ones)."""

    keys: tuple[str, ...]
    attributes: tuple[str, ...]
    index: Mapping[str, int]  # device key -> position among its values; -1 for "attributes"
    attribute_index: Mapping[str, int]  # attribute name -> position among its values
    size: int  # how many values a device of this layout has


def _layout(keys: tuple[str, ...], attributes: tuple[str, ...]) -> _DeviceLayout:
    keys = tuple(sys.intern(k) for k in keys)
    attributes = tuple(sys.intern(a) for a in attributes)
    others = [k for k in keys if k != "attributes"]
    index = {k: i for i, k in enumerate(others)}
    if "attributes" in keys:
        index["attributes"] = -1
    start = len(others)
    return _DeviceLayout(
        keys,
        attributes,
        index,
        {a: start + i for i, a in enumerate(attributes)},
        start + len(attributes),
    )


class PackedDevices(Sequence["PackedDevice"]):
    """A ResourceSlice's ``spec.devices``, packed: one tuple of every device's values (its own
    values, name, capacity, counter consumption..., then its attributes' values) and one layout
    per device, shared with every device that has the same keys. Reading a device gives a
    `PackedDevice` view over the tuple; nothing per device is kept but its values."""

    __slots__ = ("_layouts", "_values")

    def __init__(self, layouts: tuple[_DeviceLayout, ...], values: tuple[Any, ...]) -> None:
        self._layouts = layouts
        self._values = values

    def __len__(self) -> int:
        return len(self._layouts)

    @overload
    def __getitem__(self, i: int) -> PackedDevice: ...

    @overload
    def __getitem__(self, i: slice) -> list[PackedDevice]: ...

    def __getitem__(self, i: int | slice) -> PackedDevice | list[PackedDevice]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self._layouts)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("device index out of range")
        offset = sum(layout.size for layout in self._layouts[:i])
        return PackedDevice(self._layouts[i], self._values, offset)

    def __iter__(self) -> Iterator[PackedDevice]:
        offset = 0
        for layout in self._layouts:
            yield PackedDevice(layout, self._values, offset)
            offset += layout.size

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedDevices | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedDevices({list(self)!r})"


class _PackedView(Mapping[str, Any]):
    """A read-only mapping over one packed device's values: names in order, and each name's
    position among the device's values (a device's own keys, or its attributes' names)."""

    __slots__ = ("_index", "_layout", "_names", "_offset", "_values")

    def __init__(
        self,
        layout: _DeviceLayout,
        values: tuple[Any, ...],
        offset: int,
        names: tuple[str, ...],
        index: Mapping[str, int],
    ) -> None:
        self._layout = layout
        self._values = values
        self._offset = offset
        self._names = names
        self._index = index

    def _value(self, i: int) -> Any:
        return self._values[self._offset + i]

    def __getitem__(self, key: str) -> Any:
        return self._value(self._index[key])

    def get(self, key: str, default: Any = None) -> Any:
        i = self._index.get(key)
        return default if i is None else self._value(i)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return repr(dict(self))


class PackedDevice(_PackedView):
    """One device of `PackedDevices`: a read-only mapping equal to the device's JSON. Reading
    ``["attributes"]`` gives a mapping over the same values."""

    __slots__ = ()

    def __init__(self, layout: _DeviceLayout, values: tuple[Any, ...], offset: int) -> None:
        super().__init__(layout, values, offset, layout.keys, layout.index)

    def _value(self, i: int) -> Any:
        if i < 0:  # "attributes"
            return _PackedAttributes(self._layout, self._values, self._offset)
        return self._values[self._offset + i]

    def __repr__(self) -> str:
        return f"PackedDevice({dict(self)!r})"


class _PackedAttributes(_PackedView):
    """A packed device's ``attributes``: a view over the device's values."""

    __slots__ = ()

    def __init__(self, layout: _DeviceLayout, values: tuple[Any, ...], offset: int) -> None:
        super().__init__(layout, values, offset, layout.attributes, layout.attribute_index)


def plain_json(value: Any) -> Any:
    """A cached object (or any part of one) as plain JSON: dicts and lists, no packed devices."""
    if isinstance(value, Mapping):
        return {k: plain_json(v) for k, v in value.items()}
    if isinstance(value, list | PackedDevices):
        return [plain_json(v) for v in value]
    return value


class SharedParts:
    """One object per distinct JSON value at the places a ResourceSlice repeats itself: every
    attribute value, every device's capacity map and counter consumption, every counter set's
    counters. The key is the value's compact JSON text (C-speed, and it keeps 1, 1.0 and true
    apart); device and attribute names are interned strings, and a slice's devices are packed
    (`PackedDevices`) over layouts shared by the devices with the same keys.

    Entries that no cached object uses any more are dropped whenever the table has doubled
    since the last sweep, so replaced slices do not pin their parts.
    """

    def __init__(self) -> None:
        self._table: dict[str, Any] = {}
        self._attributes: dict[tuple[str, type, object], Any] = {}
        self._layouts: dict[tuple[tuple[str, ...], tuple[str, ...]], _DeviceLayout] = {}
        self._sweep_at = 4096

    def __len__(self) -> int:
        return len(self._table) + len(self._attributes)

    def share(self, value: Any) -> Any:
        key = json.dumps(value, separators=(",", ":"))
        return self._table.setdefault(key, value)

    def __call__(self, obj: Obj) -> Obj:
        spec = strip_bookkeeping(obj).get("spec")
        if isinstance(spec, dict):
            devices = spec.get("devices")
            if isinstance(devices, list) and devices:
                spec["devices"] = self._devices(devices)
            for counter_set in spec.get("sharedCounters") or ():
                if isinstance(counter_set, dict) and "counters" in counter_set:
                    counter_set["counters"] = self.share(counter_set["counters"])
        if len(self) >= self._sweep_at:
            self.sweep()
        return obj

    def _devices(self, devices: list[Any]) -> list[Any] | PackedDevices:
        layouts: list[_DeviceLayout] = []
        values: list[Any] = []
        for device in devices:
            attributes = device.get("attributes", {}) if isinstance(device, dict) else None
            if not isinstance(attributes, dict):
                # Not what the API sends: kept as it came, its parts shared.
                return [self._share_device(d) if isinstance(d, dict) else d for d in devices]
            self._share_device(device)
            keys, names = tuple(device), tuple(attributes)
            layout = self._layouts.get((keys, names))
            if layout is None:
                layout = self._layouts.setdefault((keys, names), _layout(keys, names))
            layouts.append(layout)
            values += [device[k] for k in layout.keys if k != "attributes"]
            values += [self._attribute(v) for v in attributes.values()]
        return PackedDevices(tuple(layouts), tuple(values))

    def _share_device(self, device: Obj) -> Obj:
        name = device.get("name")
        if isinstance(name, str):
            device["name"] = sys.intern(name)
        for key in ("capacity", "consumesCounters"):
            if key in device:
                device[key] = self.share(device[key])
        return device

    def _attribute(self, value: Any) -> Any:
        """An attribute value is one `{type: value}` pair: keyed without JSON, by the pair."""
        if isinstance(value, dict) and len(value) == 1:
            ((kind, item),) = value.items()
            if isinstance(item, str | int | bool) and not isinstance(item, float):
                return self._attributes.setdefault((kind, type(item), item), value)
        return self.share(value)

    def sweep(self) -> int:
        """Drop entries only the tables still hold; returns how many went."""
        dropped = (
            _sweep(self._table, "\0probe")
            + _sweep(self._attributes, ("", type(None), None))
            + _sweep(self._layouts, (("\0probe",), ()))
        )
        self._sweep_at = max(4096, 2 * len(self))
        return dropped


def _sweep(table: dict[Any, Any], probe_key: Any) -> int:
    """Delete the entries of `table` that nothing else references. The floor is measured on a
    fresh probe entry, read exactly as the others are, so it holds on any interpreter."""
    table[probe_key] = []
    floor = sys.getrefcount(table[probe_key])
    stale = [k for k in table if sys.getrefcount(table[k]) <= floor]
    for k in stale:
        del table[k]
    return len(stale) - 1  # the probe itself


def slice_view() -> Callable[[Obj], Obj]:
    """The ResourceSlice informer's transform (one table per informer thread)."""
    return SharedParts()


_NODE_KEEP_SPEC = ("taints", "unschedulable")
_NODE_KEEP_STATUS = ("allocatable", "conditions")
_NODE_KEEP_META = ("name", "uid", "resourceVersion", "labels", "deletionTimestamp")


def trim_node(node: Obj) -> Obj:
    """What the controller reads of a Node (its images, addresses and daemon endpoints are
    most of a Node's bytes and none of carve's business)."""
    view = NodeView(node)
    meta, spec, status = view.metadata, view.spec, view.status
    conditions = [
        {k: c.get(k) for k in ("type", "status", "lastTransitionTime", "reason") if k in c}
        for c in view.conditions
    ]
    out: Obj = {
        "metadata": {k: meta[k] for k in _NODE_KEEP_META if k in meta},
        "spec": {k: spec[k] for k in _NODE_KEEP_SPEC if k in spec},
        "status": {k: status[k] for k in _NODE_KEEP_STATUS if k in status},
    }
    if "conditions" in out["status"]:
        out["status"]["conditions"] = conditions
    if "kind" in node:
        out["kind"] = node["kind"]
    return out
