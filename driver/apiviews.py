"""Typed read-only views of the few API object shapes carve reads, over the JSON itself.

Both programs read Pods, ResourceClaims, Nodes, ResourceSlices and DeviceClasses as the
apiserver serves them (`Obj`, camelCase keys). Spelling each read as a chain of ``.get``
calls repeats the same defensive shape (a missing or null ``metadata``, ``spec`` or
``status``) at every call site and hides what is being read. A view names the read once.

Views copy nothing and check nothing when made: a view is one slot holding the object
(``raw``, for code that still needs the whole shape; writes build their bodies from the dict
they hold, never through a view), and each accessor
reads through it when asked. So making one is as cheap as a tuple, and a view of an object
that changes later reads the change. The controller makes them on its decision path, which is
why they are plain slotted classes: a frozen dataclass pays for its ``__setattr__`` guard on
every construction. The hottest reads (the store key, whether a pod ended or carries a gate,
whether a claim is allocated) are also plain functions, which the views' accessors call:
the controller asks them of every pod or claim in a scan, where making a view costs as much
as the read.

No accessor raises on a shape the API would not send: a missing, null, empty or mistyped
field at any level reads as absent ("", 0, an empty mapping or sequence, None), so a malformed
object is recognised and reported by the code that acts on it, not by an accessor. The
accessors are the ones carve's code reads; a new read adds one here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from driver.allocation import pinned_node

_EMPTY: Mapping[str, Any] = MappingProxyType({})

TERMINAL_PHASES = ("Succeeded", "Failed")
"""A pod in one of these phases has ended: its containers will not run again."""


def _map(value: object) -> Mapping[str, Any]:
    """`value` when it is a JSON object, else an empty one (the fast path is a plain dict)."""
    if type(value) is dict:
        return value
    return value if isinstance(value, Mapping) else _EMPTY


def _seq(value: object) -> Sequence[Any]:
    """`value` when it is a JSON array (or a read-only sequence standing for one), else ()."""
    if type(value) is list:
        return value
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value
    return ()


def _maps(value: object) -> list[Mapping[str, Any]]:
    """The objects of a JSON array, skipping entries that are not objects."""
    if not value:
        return []
    return [v for v in _seq(value) if type(v) is dict or isinstance(v, Mapping)]


def _str(value: object) -> str:
    """A string field: "" when absent, null or not a string."""
    return value if isinstance(value, str) else ""


def _int(value: object) -> int:
    """An integer field: 0 when absent, null or not a number."""
    if type(value) is int:
        return value
    if not isinstance(value, int | float | str):
        return 0
    try:
        return int(value)
    except (ValueError, OverflowError):
        return 0


def key_of(obj: Mapping[str, Any]) -> str:
    """The store key of an object: ``namespace/name``, or ``name`` for a cluster-scoped one.

    A plain function, not only `ObjectView.key`, because every informer event and every
    decision computes it. A name-less object keys as ``None`` (as it always has: the key is
    logged and compared, never parsed).
    """
    meta = obj.get("metadata")
    if type(meta) is not dict:
        meta = _map(meta)
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


def is_terminal(pod: Mapping[str, Any]) -> bool:
    """`PodView.terminal`, as a plain function for the controller's per-pod scans."""
    status = pod.get("status")
    if type(status) is not dict:
        status = _map(status)
    return status.get("phase") in TERMINAL_PHASES


def is_allocated(claim: Mapping[str, Any]) -> bool:
    """`ClaimView.allocated`, as a plain function for the controller's per-claim scans."""
    status = claim.get("status")
    if type(status) is not dict:
        status = _map(status)
    return bool(status.get("allocation"))


def has_gate(pod: Mapping[str, Any], gate: str) -> bool:
    """`PodView.has_gate`, as a plain function for the controller's per-pod scans."""
    spec = pod.get("spec")
    if type(spec) is not dict:
        spec = _map(spec)
    for g in _seq(spec.get("schedulingGates")):
        if (type(g) is dict or isinstance(g, Mapping)) and g.get("name") == gate:
            return True
    return False


class ObjectView:
    """What every API object has: its ``metadata``."""

    __slots__ = ("raw",)

    raw: Mapping[str, Any]
    """The object itself (an `Obj` as the API serves it), for code that needs its whole shape;
    a writer keeps its own reference to the dict it writes."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({key_of(self.raw)})"

    # metadata, spec and status test for a plain dict inline: they are read on every access.
    @property
    def metadata(self) -> Mapping[str, Any]:
        meta = self.raw.get("metadata")
        return meta if type(meta) is dict else _map(meta)

    @property
    def name(self) -> str:
        return _str(self.metadata.get("name"))

    @property
    def namespace(self) -> str:
        return _str(self.metadata.get("namespace"))

    @property
    def uid(self) -> str:
        return _str(self.metadata.get("uid"))

    @property
    def key(self) -> str:
        return key_of(self.raw)

    @property
    def resource_version(self) -> str:
        return _str(self.metadata.get("resourceVersion"))

    @property
    def generation(self) -> int:
        return _int(self.metadata.get("generation"))

    @property
    def creation_timestamp(self) -> str:
        """RFC 3339 in UTC, so two of them compare as strings; "" when unset."""
        return _str(self.metadata.get("creationTimestamp"))

    @property
    def deletion_timestamp(self) -> str | None:
        return self.metadata.get("deletionTimestamp") or None

    @property
    def deleting(self) -> bool:
        """Whether the object is being deleted (it waits on its finalizers)."""
        return bool(self.metadata.get("deletionTimestamp"))

    @property
    def labels(self) -> Mapping[str, Any]:
        return _map(self.metadata.get("labels"))

    @property
    def annotations(self) -> Mapping[str, Any]:
        return _map(self.metadata.get("annotations"))

    @property
    def finalizers(self) -> Sequence[str]:
        return _seq(self.metadata.get("finalizers"))

    def has_finalizer(self, finalizer: str) -> bool:
        return finalizer in self.finalizers

    @property
    def owner_references(self) -> list[Mapping[str, Any]]:
        return _maps(self.metadata.get("ownerReferences"))

    def owned_by(self, uid: str) -> bool:
        """Whether one of the object's owner references names the object with this UID."""
        return any(ref.get("uid") == uid for ref in self.owner_references)

    @property
    def spec(self) -> Mapping[str, Any]:
        spec = self.raw.get("spec")
        return spec if type(spec) is dict else _map(spec)

    @property
    def status(self) -> Mapping[str, Any]:
        status = self.raw.get("status")
        return status if type(status) is dict else _map(status)


def _condition(conditions: Sequence[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    for c in conditions:
        if c.get("type") == type_:
            return c
    return None


class PodView(ObjectView):
    """A Pod: where it is bound, whether it ended, its gates, claims, containers and priority."""

    __slots__ = ()

    @property
    def node_name(self) -> str:
        """The node the pod is bound to; "" while it is not."""
        return _str(self.spec.get("nodeName"))

    @property
    def phase(self) -> str:
        return _str(self.status.get("phase"))

    @property
    def terminal(self) -> bool:
        """Whether the pod ended (Succeeded or Failed): nothing of it runs any more."""
        return is_terminal(self.raw)

    @property
    def priority(self) -> int:
        """``spec.priority`` (0 when unset, as for a pod without a PriorityClass)."""
        return _int(self.spec.get("priority"))

    @property
    def start_time(self) -> str | None:
        return self.status.get("startTime") or None

    @property
    def scheduling_gates(self) -> list[str]:
        """The names of the pod's scheduling gates, in spec order."""
        return [_str(g.get("name")) for g in _maps(self.spec.get("schedulingGates"))]

    def has_gate(self, gate: str) -> bool:
        return has_gate(self.raw, gate)

    @property
    def resource_claims(self) -> list[Mapping[str, Any]]:
        """``spec.resourceClaims``: each entry's ``name`` and the claim or template it names."""
        return _maps(self.spec.get("resourceClaims"))

    @property
    def resource_claim_statuses(self) -> list[Mapping[str, Any]]:
        """``status.resourceClaimStatuses``: the claims kube-controller-manager generated."""
        return _maps(self.status.get("resourceClaimStatuses"))

    @property
    def containers(self) -> list[Mapping[str, Any]]:
        return _maps(self.spec.get("containers"))

    @property
    def init_containers(self) -> list[Mapping[str, Any]]:
        return _maps(self.spec.get("initContainers"))

    @property
    def container_statuses(self) -> list[Mapping[str, Any]]:
        return _maps(self.status.get("containerStatuses"))

    @property
    def affinity(self) -> Mapping[str, Any]:
        return _map(self.spec.get("affinity"))

    @property
    def conditions(self) -> list[Mapping[str, Any]]:
        return _maps(self.status.get("conditions"))

    def condition(self, type_: str) -> Mapping[str, Any] | None:
        """The pod's condition of `type_`, whatever its status; None when it has none."""
        return _condition(self.conditions, type_)


class ClaimView(ObjectView):
    """A ResourceClaim: its requests as written, and its allocation and consumers."""

    __slots__ = ()

    @property
    def requests(self) -> list[Mapping[str, Any]]:
        """``spec.devices.requests``, as written (before any validation)."""
        return _maps(_map(self.spec.get("devices")).get("requests"))

    @property
    def config(self) -> list[Mapping[str, Any]]:
        """``spec.devices.config``: the claim's own configuration entries."""
        return _maps(_map(self.spec.get("devices")).get("config"))

    @property
    def class_names(self) -> list[str]:
        """The DeviceClass names the requests and their subrequests name, in order, read from
        the raw object so that a claim that fails validation is still known by its classes."""
        names: list[str] = []
        for req in self.requests:
            exact = req.get("exactly")
            if isinstance(exact, Mapping) and exact.get("deviceClassName"):
                names.append(str(exact["deviceClassName"]))
            for sub in _seq(req.get("firstAvailable")):
                if isinstance(sub, Mapping) and sub.get("deviceClassName"):
                    names.append(str(sub["deviceClassName"]))
        return names

    @property
    def allocation(self) -> Mapping[str, Any]:
        """``status.allocation``; empty while the claim is not allocated."""
        return _map(self.status.get("allocation"))

    @property
    def allocated(self) -> bool:
        return is_allocated(self.raw)

    @property
    def results(self) -> list[Mapping[str, Any]]:
        """``status.allocation.devices.results``: one entry per allocated device."""
        return _maps(_map(self.allocation.get("devices")).get("results"))

    def holds_driver(self, driver: str) -> bool:
        """Whether the allocation holds a device of `driver` (whichever class asked for it)."""
        return any(r.get("driver") == driver for r in self.results)

    @property
    def node(self) -> str | None:
        """The one node the allocation pins the claim to, None for a node-less allocation or
        none at all; the rule is `driver.allocation.pinned_node`, which the planner's hold of
        the claim reads too, so the claims carve counts on a node are the ones it frees when
        that node is lost."""
        return pinned_node(self.allocation.get("nodeSelector"))

    @property
    def reserved_for(self) -> list[Mapping[str, Any]]:
        """``status.reservedFor``: the consumers (pods) that use the claim now."""
        return _maps(self.status.get("reservedFor"))

    @property
    def device_statuses(self) -> list[Mapping[str, Any]]:
        """``status.devices``: what the drivers report per allocated device."""
        return _maps(self.status.get("devices"))


class NodeView(ObjectView):
    """A Node, as far as node fit and node loss read it."""

    __slots__ = ()

    @property
    def taints(self) -> list[Mapping[str, Any]]:
        return _maps(self.spec.get("taints"))

    @property
    def unschedulable(self) -> bool:
        """Whether the node is cordoned."""
        return bool(self.spec.get("unschedulable"))

    @property
    def allocatable(self) -> Mapping[str, Any]:
        return _map(self.status.get("allocatable"))

    @property
    def conditions(self) -> list[Mapping[str, Any]]:
        return _maps(self.status.get("conditions"))

    def condition(self, type_: str) -> Mapping[str, Any] | None:
        """The node's condition of `type_` (``Ready``), None when it reports none."""
        return _condition(self.conditions, type_)


class SliceView(ObjectView):
    """A ResourceSlice: whose, which node's, which pool, and its devices."""

    __slots__ = ()

    @property
    def driver(self) -> str:
        return _str(self.spec.get("driver"))

    @property
    def node_name(self) -> str:
        """The node whose devices the slice publishes; "" for a node-less slice."""
        return _str(self.spec.get("nodeName"))

    @property
    def pool_name(self) -> str:
        return _str(_map(self.spec.get("pool")).get("name"))

    @property
    def pool_generation(self) -> int:
        return _int(_map(self.spec.get("pool")).get("generation"))

    @property
    def devices(self) -> Sequence[Any]:
        """``spec.devices`` (a read-only sequence in the controller's cache, see
        `controller.cache`): each device is a mapping with at least a ``name``."""
        return _seq(self.spec.get("devices"))


class DeviceClassView(ObjectView):
    """A DeviceClass: the extended resource it answers to and its configuration."""

    __slots__ = ()

    @property
    def extended_resource_name(self) -> str:
        return _str(self.spec.get("extendedResourceName"))

    @property
    def config(self) -> list[Mapping[str, Any]]:
        return _maps(self.spec.get("config"))
