"""The controller's vocabulary: the kinds of object it watches, how it names and reads them,
and the values its decisions are made of (`Plan`, `Unplaceable`, `ClaimAllocation`).

Every controller module, `nodesim` and `bench` speak these words, so they live here, apart from
the reconciler that uses them and from the writer and engine that produce them: importing a
word never loads the machinery. Pure functions over the API's JSON (dicts with camelCase keys)
and frozen values; no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver import apiviews
from driver.allocation import AllocatedDevice
from driver.apiviews import ClaimView, ObjectView, PodView
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER, Contract
from process.kube import Obj


class Kind(enum.StrEnum):
    """The kinds of object the controller watches, one informer each."""

    POD = "Pod"
    CLAIM = "ResourceClaim"
    SLICE = "ResourceSlice"
    NODE = "Node"
    CLASS = "DeviceClass"
    TAINT_RULE = "DeviceTaintRule"  # an admin's device taints (resource.k8s.io/v1 from 1.37)


class EventType(enum.StrEnum):
    """What an informer saw happen to an object (the watch's event types)."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True)
class ClaimAllocation:
    """Everything the controller writes for one claim: the node and a device per request slot."""

    namespace: str
    name: str
    uid: str
    node: str
    results: tuple[AllocatedDevice, ...]  # `profile` set by the planner, for metrics and events


@dataclass(frozen=True)
class Plan:
    """Where every carve claim of one pod goes. All claims share `node`."""

    node: str
    allocations: tuple[ClaimAllocation, ...]


@dataclass(frozen=True)
class Unplaceable:
    """Why a pod cannot be placed now. `message` is shown verbatim in events and conditions.

    `permanent` marks claims that can never be satisfied as written (unknown class, CEL error,
    impossible profile): those are not retried on every capacity change, only when the pod,
    its claims or the classes change.
    """

    reason: str
    message: str
    permanent: bool = False


@dataclass(frozen=True)
class Problem:
    """Something inconsistent in what the API says (two claims allocated one device, a whole
    GPU and its slices at once); reported, never fatal. `claims` are the store keys
    (``namespace/name``) of the claims involved, the objects a user is told on."""

    subject: str
    message: str
    claims: tuple[str, ...] = ()


@dataclass(frozen=True)
class CarveClasses:
    """Which DeviceClasses are carve's: the configured names plus any `<x>.<first name>` class.

    The same rule is encoded in the admission policy (deploy/), so the gate and the controller
    agree on which pods are carve's.
    """

    names: frozenset[str] = DEFAULT_CONTRACT.default_classes
    suffix: str = DEFAULT_CONTRACT.profile_class_suffix

    @classmethod
    def of(cls, contract: Contract, names: frozenset[str] | None = None) -> CarveClasses:
        """The classes of one installation: `names` (the contract's defaults when None) plus
        every `<x>.<driver>` class."""
        return cls(
            names=contract.default_classes if names is None else names,
            suffix=contract.profile_class_suffix,
        )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.names or name.endswith(self.suffix))


# The hottest reads are driver.apiviews' plain functions, named here with the rest of the
# vocabulary: key_of is the store key (``namespace/name``) of every object the controller holds.
key_of = apiviews.key_of
is_terminal = apiviews.is_terminal
is_allocated = apiviews.is_allocated
has_gate = apiviews.has_gate


def claim_class_names(claim: Obj) -> list[str]:
    """DeviceClass names a claim's requests and subrequests name, read from the raw object
    before the spec is validated (so a malformed claim is still recognised as carve's)."""
    return ClaimView(claim).class_names


def is_carve_claim(claim: Obj, classes: CarveClasses) -> bool:
    return any(name in classes for name in ClaimView(claim).class_names)


def pod_claim_refs(pod: Obj) -> dict[str, str | None]:
    """Each `spec.resourceClaims[].name` of the pod and the name of the claim object it stands
    for: None while a template's claim has not been generated, or when kube-controller-manager
    recorded that the pod does not need it after all."""
    view = PodView(pod)
    return _claim_refs(view.resource_claims, view.resource_claim_statuses)


def _claim_refs(
    entries: Sequence[Mapping[str, Any]], statuses: Sequence[Mapping[str, Any]]
) -> dict[str, str | None]:
    generated = {s.get("name"): s.get("resourceClaimName") for s in statuses}
    refs: dict[str, str | None] = {}
    for ref in entries:
        entry = str(ref.get("name"))
        if ref.get("resourceClaimName"):
            refs[entry] = str(ref["resourceClaimName"])
        elif ref.get("resourceClaimTemplateName"):
            claim_name = generated.get(ref.get("name"))
            refs[entry] = str(claim_name) if claim_name else None
    return refs


def pod_claim_names(pod: Obj) -> tuple[list[str], list[str]]:
    """Names of the claims a pod uses, and the pod-claim entries whose claim does not exist yet."""
    view = PodView(pod)
    entries, statuses = view.resource_claims, view.resource_claim_statuses
    if not entries:
        return [], []
    generated = {s.get("name") for s in statuses}
    refs = _claim_refs(entries, statuses)
    names: list[str] = []
    missing: list[str] = []
    for ref in entries:
        claim_name = refs.get(str(ref.get("name")))
        if claim_name is not None:
            names.append(claim_name)
        elif ref.get("resourceClaimTemplateName") and ref.get("name") not in generated:
            missing.append(str(ref.get("name")))
    return names, missing


def handed_to_scheduler(claim: Obj, contract: Contract) -> bool:
    """Whether the controller left this claim to kube-scheduler (native fallback)."""
    return ObjectView(claim).annotations.get(contract.allocator_annotation) == HANDED_TO_SCHEDULER


def priority_key(pod: Obj) -> tuple[int, str, str]:
    """Queue order: higher `spec.priority` first, then older pods, then name for stability."""
    view = PodView(pod)
    return (-view.priority, view.creation_timestamp, key_of(pod))


def has_finalizer(obj: Obj, finalizer: str) -> bool:
    return ObjectView(obj).has_finalizer(finalizer)


def has_condition(pod: Obj, type_: str) -> bool:
    """Whether the pod's status carries a condition of `type_` (whatever its status)."""
    return PodView(pod).condition(type_) is not None


def other_gates(pod: Obj, gate: str) -> list[str]:
    """The pod's scheduling gates other than `gate`, in spec order. Another gate (Kueue's
    `kueue.x-k8s.io/admission`, a policy engine's) means someone else has not yet agreed to the
    pod running: carve must not spend GPU capacity on it until its own gate is the last."""
    return [g for g in PodView(pod).scheduling_gates if g != gate]


def node_finalizers(claim: Obj, contract: Contract = DEFAULT_CONTRACT) -> list[str]:
    """Finalizers that this installation's kubelet plugins put on a claim."""
    return [f for f in ObjectView(claim).finalizers if contract.is_node_finalizer(f)]


def _resource_version(obj: Obj | None) -> int | None:
    if obj is None:
        return None
    try:
        return int(ObjectView(obj).resource_version)
    except ValueError:
        return None


def is_older(new: Obj, old: Obj | None) -> bool:
    """True if `new` is an older version of the same object than `old` (a late watch event).

    resourceVersion is opaque by contract, but kube-apiserver's are etcd revisions; comparing
    them is the only way to keep a just-written claim from being overwritten by a stale event.
    """
    if old is None:
        return False
    if ObjectView(new).uid != ObjectView(old).uid:
        return False
    a, b = _resource_version(new), _resource_version(old)
    return a is not None and b is not None and a < b
