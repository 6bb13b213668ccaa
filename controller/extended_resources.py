"""Pods that ask for carve's devices through `resources.limits` (DRA extended resources).

A pod that writes `nvidia.com/mig-3g.40gb: 1` in a container's limits names no claim: on
Kubernetes 1.37 kube-scheduler maps the name to the DeviceClass whose `extendedResourceName`
it is, allocates a claim for it *itself* in its Filter phase (first fit over the published
devices of each node) and creates that claim only at PreBind. There is no point at which
another allocator can write the allocation (docs/extended-resources.md, proved by
tests/controller/cluster/test_extended_resources_cluster.py), so carve takes part where the
scheduler leaves room: the pod is gated at admission, carve's engine chooses the node by best
fit on a claim that stands in for the scheduler's, and carve pins the pod to that node before
it removes the gate. kube-scheduler then allocates on that node only.

This module is the pure part: which names are carve's, what a pod asks, the stand-in claim,
and the node affinity that pins the pod. The writes live in `controller.status`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.apiviews import ClaimView, DeviceClassView, ObjectView, PodView
from driver.contract import EXTENDED_RESOURCE_CLAIM_ANNOTATION, IMPLICIT_EXTENDED_RESOURCE_PREFIX
from process.kube import Obj

__all__ = [
    "PINNED_SETTLE_SECONDS",
    "ExtendedRequest",
    "ExtendedResourceError",
    "PinnedPods",
    "asks_carve_resources",
    "extended_requests",
    "extended_stand_in",
    "in_users_words",
    "pinned_affinity",
    "resource_classes",
    "stand_in_claim",
]


_WHOLE_NUMBER = re.compile(r"[0-9]+")


class ExtendedResourceError(ValueError):
    """The pod asks for carve's extended resources in a way carve does not place; the message
    names the container and the resource, for the pod's event and condition (`reason`)."""

    def __init__(self, message: str, reason: str = "InvalidExtendedResourceRequest") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ExtendedRequest:
    """One container's ask for one extended resource, as kube-scheduler turns it into a request
    of the pod's extended-resource claim (`container-<i>-request-<j>`)."""

    request: str
    container: str
    resource: str
    device_class: str
    count: int


def resource_classes(classes: Mapping[str, Obj], carve: Container[str]) -> dict[str, str]:
    """Extended resource name -> carve DeviceClass, resolved as kube-scheduler resolves it.

    Every class answers to `deviceclass.resource.kubernetes.io/<name>`; a class with
    `spec.extendedResourceName` also answers to that name, and when two classes claim one
    name the newest wins (ties: the smaller name), as in the scheduler's extended-resource
    cache. Only carve's classes are considered: a name that only another driver's class maps
    is not carve's business.
    """
    out: dict[str, str] = {}
    chosen: dict[str, tuple[str, str]] = {}
    for name, cls in classes.items():
        if name not in carve:
            continue
        out[IMPLICIT_EXTENDED_RESOURCE_PREFIX + name] = name
        view = DeviceClassView(cls)
        ext = view.extended_resource_name
        if not ext:
            continue
        created = view.creation_timestamp
        best = chosen.get(ext)
        # RFC 3339 timestamps in UTC compare as strings; newest first, then the smaller name.
        if best is None or (created, _reverse(name)) > (best[0], _reverse(best[1])):
            chosen[ext] = (created, name)
    out.update({ext: name for ext, (_, name) in chosen.items()})
    return out


def _reverse(name: str) -> tuple[int, ...]:
    """A key under which the smaller name compares greater."""
    return tuple(-ord(ch) for ch in name)


def _containers(pod: Obj) -> list[tuple[int, Obj, bool]]:
    """(index as the scheduler numbers it, container, is a short-lived init container)."""
    spec = PodView(pod).spec
    inits = list(spec.get("initContainers") or [])
    out: list[tuple[int, Obj, bool]] = []
    for i, c in enumerate(inits):
        out.append((i, c, c.get("restartPolicy") != "Always"))
    out.extend((len(inits) + i, c, False) for i, c in enumerate(spec.get("containers") or []))
    return out


def _asked(container: Obj) -> dict[str, Any]:
    """A container's extended resources: limits, and requests where no limit is given (the
    apiserver requires them equal, and defaults requests from limits)."""
    res = container.get("resources") or {}
    return {**(res.get("requests") or {}), **(res.get("limits") or {})}


def asks_carve_resources(pod: Obj, names: Container[str]) -> bool:
    """Whether any container asks for one of carve's extended resource names."""
    return any(name in names for _, c, _ in _containers(pod) for name in _asked(c))


def extended_requests(pod: Obj, names: Mapping[str, str]) -> tuple[ExtendedRequest, ...]:
    """What the pod asks of carve through extended resources, one request per container and
    resource, named as kube-scheduler names them. Raises ExtendedResourceError for asks carve
    cannot honour as written."""
    out: list[ExtendedRequest] = []
    for index, container, short_lived in _containers(pod):
        cname = str(container.get("name", f"#{index}"))
        asked = _asked(container)
        keys = sorted((container.get("resources") or {}).get("requests") or asked)
        for resource in sorted(asked):
            cls = names.get(resource)
            if cls is None:
                continue
            where = f"container {cname}: resources.limits[{resource}]"
            if short_lived:
                raise ExtendedResourceError(
                    f"init container {cname} asks for {resource}; carve places extended "
                    "resources of regular containers and sidecars (restartPolicy: Always) "
                    "only; give the init container a ResourceClaim, or move the ask to a "
                    "regular container"
                )
            raw = str(asked[resource])
            if not _WHOLE_NUMBER.fullmatch(raw) or int(raw) == 0:
                raise ExtendedResourceError(
                    f"{where}: {raw!r} is not a whole number of devices (write e.g. 1)"
                )
            ridx = keys.index(resource) if resource in keys else 0
            out.append(
                ExtendedRequest(f"container-{index}-request-{ridx}", cname, resource, cls, int(raw))
            )
    return tuple(out)


def stand_in_claim(pod: Obj, requests: Sequence[ExtendedRequest]) -> Obj:
    """An in-memory claim shaped as the one kube-scheduler will create for the pod, for carve's
    placement engine to place. It is never written; its name cannot clash with a real claim
    (it is not a valid object name, like the scheduler's own `<extended-resources>`)."""
    view = ObjectView(pod)
    return {
        "metadata": {
            "namespace": view.namespace,
            "name": f"<extended-resources of {view.name}>",
            "uid": f"extended-resources-{view.uid}",
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": r.request,
                        "exactly": {
                            "deviceClassName": r.device_class,
                            "allocationMode": "ExactCount",
                            "count": r.count,
                        },
                    }
                    for r in requests
                ]
            }
        },
    }


def extended_stand_in(pod: Obj, carve_claims: Sequence[Obj], names: Mapping[str, str]) -> Obj:
    """The stand-in claim for a gated pod that asks through extended resources.

    A pod that also uses carve claims is refused: carve would allocate the claims and
    kube-scheduler the extended resources, two allocators on one node with no common
    decision, so neither could keep the other's best fit (nor the all-or-nothing rule).
    """
    if carve_claims:
        asked = sorted({r for _, c, _ in _containers(pod) for r in _asked(c) if r in names})
        claims = sorted(ObjectView(c).name for c in carve_claims)
        raise ExtendedResourceError(
            f"the pod asks for {', '.join(asked)} through resources.limits and also uses carve "
            f"ResourceClaims ({', '.join(claims)}); carve places one or the other for a pod: "
            "ask for the slice in a claim as well, or drop the claims",
            reason="MixedClaimsAndExtendedResources",
        )
    requests = extended_requests(pod, names)
    if not requests:
        raise ExtendedResourceError("the pod asks for no carve extended resource")
    return stand_in_claim(pod, requests)


def in_users_words(message: str, pod: Obj, names: Mapping[str, str]) -> str:
    """The engine's message about the stand-in claim, rewritten to name what the user wrote
    (`nvidia.com/mig-7g.141gb of container main`): the stand-in's name exists nowhere else."""
    claim = ObjectView(stand_in_claim(pod, ()))
    prefix = f"claim {claim.namespace}/{claim.name}"
    try:
        requests = extended_requests(pod, names)
    except ExtendedResourceError:
        requests = ()
    for r in requests:
        message = message.replace(
            f"{prefix}, request {r.request}", f"{r.resource} of container {r.container}"
        )
    return message.replace(prefix, "the pod's extended resources")


def pinned_affinity(pod: Obj, node: str) -> Obj:
    """The pod's `spec.affinity` narrowed to `node`, as a gated pod may be changed.

    Kubernetes lets a pod's scheduling directives change while it has scheduling gates, but
    only by narrowing: with no required node affinity one term is added; with terms, the node
    requirement is added to every term (they are ORed, so each must require it).
    """
    affinity = copy.deepcopy(dict(PodView(pod).affinity))
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    match = {"key": "metadata.name", "operator": "In", "values": [node]}
    terms = list(required.get("nodeSelectorTerms") or [])
    if not terms:
        terms = [{"matchFields": [match]}]
    else:
        terms = [{**t, "matchFields": [*(t.get("matchFields") or []), match]} for t in terms]
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
        **required,
        "nodeSelectorTerms": terms,
    }
    return affinity


PINNED_SETTLE_SECONDS = 30.0
"""How long a node stays reserved for a pinned pod whose claim has not appeared: long enough
for kube-scheduler's cycle and PreBind, short enough that a pod the scheduler cannot bind (it
fails there for a reason carve does not model) does not hold the node's placements for long."""


@dataclass(frozen=True)
class _Pin:
    node: str
    uid: str
    until: float


class PinnedPods:
    """Nodes where kube-scheduler is about to allocate a pinned pod's extended resources.

    Between the gate's removal and the scheduler's claim, carve's model does not know which
    device the scheduler will take, so an allocation carve writes on that node in the meantime
    could take the same one (two allocations of one placement). A decision that lands on such a
    node therefore waits until the pinned pod's claim is in carve's claim store (its devices
    then count in the model), the pod is gone or has ended, or `PINNED_SETTLE_SECONDS`
    passed. Other nodes are not held up.
    """

    def __init__(self) -> None:
        self._pins: dict[str, _Pin] = {}

    def pin(self, pod_key: str, uid: str, node: str, now: float) -> None:
        self._pins[pod_key] = _Pin(node, uid, now + PINNED_SETTLE_SECONDS)

    def blocker(
        self,
        node: str,
        pod_key: str,
        now: float,
        pods: Mapping[str, Obj],
        claims: Mapping[str, Obj],
    ) -> str | None:
        """The pinned pod that `node` still waits for (None: free to decide there)."""
        for key, pin in list(self._pins.items()):
            if pin.node != node or key == pod_key:
                continue
            if now >= pin.until or _settled(key, pin.uid, pods, claims):
                del self._pins[key]
                continue
            return key
        return None


def _settled(pod_key: str, uid: str, pods: Mapping[str, Obj], claims: Mapping[str, Obj]) -> bool:
    pod = pods.get(pod_key)
    if pod is None or PodView(pod).uid != uid:
        return True
    if PodView(pod).terminal:
        return True
    namespace = pod_key.partition("/")[0]
    for key, claim in claims.items():
        if not key.startswith(f"{namespace}/"):
            continue
        view = ClaimView(claim)
        if view.annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) != "true":
            continue
        if view.owned_by(uid) and view.allocated:
            return True
    return False
