"""What carve tells Cluster Autoscaler (issue 44 item 5): the rules, as pure functions.

Cluster Autoscaler (CA) scales up only for a pod that is not bound, not being deleted, and whose
first `PodScheduled` condition has status `False` and reason `Unschedulable`
(kubernetes/autoscaler, cluster-autoscaler/utils/kubernetes/listers.go, `isUnschedulable`). A
pod behind carve's scheduling gate reads `SchedulingGated` (the apiserver sets it at creation),
so CA never sees it. carve therefore writes the condition itself, the *hint*, while it cannot
place a gated pod for lack of capacity, and turns it back to the apiserver's `SchedulingGated`
before it removes its gate, so kube-scheduler starts from what it would have found without
carve. Never while carve is preempting for the pod, a queue (Kueue) holds it, or a placement
that would fit it is being released: capacity is on its way then, and a new node would be
waste.

The writes (`controller.status.KubeClaimWriter`) are JSON patches of the pod's status pinned by
`test` operations: the hint only onto a pod that still has carve's gate (a late hint can never
land on a pod carve has ungated), the gate's removal only onto a pod whose `PodScheduled` is as
carve saw it (a hint that landed meanwhile is reset first).

A pod that holds a live slice and is not opted in as movable (`Contract.movable_annotation`)
gets `cluster-autoscaler.kubernetes.io/safe-to-evict: "false"` when carve ungates it, unless
its user set that annotation: a scale-down must not drain a pod whose MIG instance another node
may not have room for.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from controller.objects import Unplaceable
from driver.apiviews import ClaimView, PodView
from driver.contract import Contract
from process.kube import Obj
from process.kube.rmw import WriteSkippedError

SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
"""CA's per-pod opt-out of scale-down (cluster-autoscaler/utils/drain)."""

POD_SCHEDULED = "PodScheduled"
UNSCHEDULABLE = "Unschedulable"
SCHEDULING_GATED = "SchedulingGated"
SCHEDULING_GATED_MESSAGE = "Scheduling is blocked due to non-empty scheduling gates"
"""What kube-apiserver writes on a gated pod at creation (pkg/registry/core/pod/strategy.go)."""

HINT_PREFIX = "carve cannot place this pod for lack of capacity"
"""How every hint's message begins: a reader (and a test) tells carve's from kube-scheduler's."""

CAPACITY_REASONS = frozenset(
    {
        "InsufficientDevices",  # no node has room for all the pod's devices
        "NodeMisfit",  # no GPU node takes the pod (CPU, memory, taints, selectors)
        "NoNode",  # no node publishes carve GPUs (a node group scaled to zero)
        "NoMatchingDevice",  # no published device matches: a node of another group may
        "PreemptionBlocked",  # evictions would free room, PodDisruptionBudgets forbid them
    }
)
"""The refusals a new node could end. Everything else is not capacity: a bad claim or class
(permanent), claims not created yet, a conflict, a failed carve or write, and the waits that
end by themselves (`Preempting`, `PreemptionPending`, another gate)."""


def lacks_capacity(why: Unplaceable) -> bool:
    """Whether `why` is a refusal a new node could end (`CAPACITY_REASONS`, never permanent)."""
    return not why.permanent and why.reason in CAPACITY_REASONS


def hint_message(claims: Sequence[Obj], why: Unplaceable) -> str:
    """The hint's message: what the pod asks for, and why nothing fits now."""
    asked = "; ".join(_asks(c) for c in claims) or "carve devices"
    return f"{HINT_PREFIX}: it asks for {asked}; {why.message}"


def _asks(claim: Obj) -> str:
    view = ClaimView(claim)
    parts = []
    for req in view.requests:
        exact = req.get("exactly")
        if isinstance(exact, Mapping):
            parts.append(_one(exact))
            continue
        alternatives = [
            _one(sub) for sub in req.get("firstAvailable") or [] if isinstance(sub, Mapping)
        ]
        parts.append(" or ".join(alternatives) or "?")
    return f"claim {view.name} ({', '.join(parts)})"


def _one(request: Mapping[str, Any]) -> str:
    """e.g. `8 x mig.carve.dev where device.attributes[...].profile == "1g.5gb"`."""
    text = f"{_count(request)} {request.get('deviceClassName', '?')}"
    exprs = [
        str(sel["cel"].get("expression", ""))
        for sel in request.get("selectors") or []
        if isinstance(sel, Mapping) and isinstance(sel.get("cel"), Mapping)
    ]
    if exprs:
        where = " && ".join(exprs)
        text += f" where {where if len(where) <= _MAX_SELECTOR else where[:_MAX_SELECTOR] + '...'}"
    return text


_MAX_SELECTOR = 200


def _count(request: Mapping[str, Any]) -> str:
    if request.get("allocationMode") == "All":
        return "all"
    return f"{request.get('count', 1)} x"


def scheduled_condition(pod: Obj) -> tuple[int, Mapping[str, Any]] | None:
    """The pod's first `PodScheduled` condition and its index (the one CA reads)."""
    for i, cond in enumerate(PodView(pod).conditions):
        if cond.get("type") == POD_SCHEDULED:
            return i, cond
    return None


def shows_hint(pod: Obj) -> bool:
    """Whether the pod reads as unschedulable to CA (see the module)."""
    found = scheduled_condition(pod)
    return (
        found is not None
        and found[1].get("status") == "False"
        and found[1].get("reason") == UNSCHEDULABLE
    )


def hint_of(pod: Obj, gate: str) -> str | None:
    """The message of carve's hint on a pod that still has carve's gate; None when it has
    none. A gated pod is never seen by kube-scheduler, so an `Unschedulable` there is carve's."""
    if not PodView(pod).has_gate(gate) or not shows_hint(pod):
        return None
    found = scheduled_condition(pod)
    assert found is not None
    return str(found[1].get("message") or "")


def _condition(reason: str, message: str, now: dt.datetime) -> Obj:
    return {
        "type": POD_SCHEDULED,
        "status": "False",
        "reason": reason,
        "message": message[:32768],
        "lastProbeTime": None,
        "lastTransitionTime": now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _gate_index(pod: Obj, gate: str) -> int | None:
    for i, g in enumerate(PodView(pod).spec.get("schedulingGates") or []):
        if isinstance(g, Mapping) and g.get("name") == gate:
            return i
    return None


def _put_condition(pod: Obj, cond: Obj) -> list[Obj]:
    """Operations that put `cond` in place of the pod's `PodScheduled` (tested at its index),
    or add it."""
    found = scheduled_condition(pod)
    if found is not None:
        path = f"/status/conditions/{found[0]}"
        return [
            {"op": "test", "path": f"{path}/type", "value": POD_SCHEDULED},
            {"op": "replace", "path": path, "value": cond},
        ]
    if PodView(pod).status.get("conditions") is not None:
        return [{"op": "add", "path": "/status/conditions/-", "value": cond}]
    return [{"op": "add", "path": "/status/conditions", "value": [cond]}]


def hint_ops(pod: Obj, gate: str, message: str, now: dt.datetime) -> list[Obj] | None:
    """The JSON patch (of pods/status) that sets the hint, pinned on carve's gate; None when
    the pod shows that hint already. `GateGoneError` when the gate is gone."""
    i = _gate_index(pod, gate)
    if i is None:
        raise GateGoneError("carve's gate is gone: kube-scheduler owns PodScheduled now")
    if hint_of(pod, gate) == message[:32768]:
        return None
    pin = {"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": gate}
    return [pin, *_put_condition(pod, _condition(UNSCHEDULABLE, message, now))]


def reset_ops(pod: Obj, gate: str, now: dt.datetime) -> list[Obj] | None:
    """The JSON patch (of pods/status) that turns carve's hint back into the apiserver's
    `SchedulingGated`, pinned on the hint and on carve's gate; None when the pod shows no hint
    or the gate is gone (kube-scheduler owns `PodScheduled` then: never undo its verdict)."""
    i = _gate_index(pod, gate)
    if i is None or not shows_hint(pod):
        return None
    found = scheduled_condition(pod)
    assert found is not None
    path = f"/status/conditions/{found[0]}"
    cond = _condition(SCHEDULING_GATED, SCHEDULING_GATED_MESSAGE, now)
    return [
        {"op": "test", "path": f"/spec/schedulingGates/{i}/name", "value": gate},
        {"op": "test", "path": f"{path}/type", "value": POD_SCHEDULED},
        {"op": "test", "path": f"{path}/reason", "value": UNSCHEDULABLE},
        {"op": "replace", "path": path, "value": cond},
    ]


def scheduled_pin(pod: Obj) -> list[Obj]:
    """For the gate's removal: a `test` that the pod's `PodScheduled` reason is as derived,
    so a hint written in between fails the patch (and is reset first)."""
    found = scheduled_condition(pod)
    if found is None:
        return []
    path = f"/status/conditions/{found[0]}"
    return [
        {"op": "test", "path": f"{path}/type", "value": POD_SCHEDULED},
        {"op": "test", "path": f"{path}/reason", "value": found[1].get("reason")},
    ]


def wants_protection(pod: Obj, contract: Contract) -> bool:
    """Whether carve marks the pod not safe to evict as it ungates it: not opted in as movable,
    and no `safe-to-evict` of its user's."""
    annotations = PodView(pod).annotations
    if str(annotations.get(contract.movable_annotation, "")).lower() == "true":
        return False
    return SAFE_TO_EVICT not in annotations


def movable_value_error(pod: Obj, contract: Contract) -> str | None:
    """What is wrong with the pod's movable annotation, if its value is neither "true" nor
    "false": carve reads it as not movable, and its user is told so rather than left guessing
    why a scale-down never drains the node."""
    key = contract.movable_annotation
    value = PodView(pod).annotations.get(key)
    if value is None or str(value).lower() in ("true", "false"):
        return None
    return (
        f'annotation {key}: "{value}" is neither "true" nor "false"; carve reads the pod as not '
        f'movable, so it is marked {SAFE_TO_EVICT}: "false" unless that annotation is set. '
        f'Set {key}: "true" to let a scale-down move it'
    )


def protection_ops(pod: Obj) -> list[Obj]:
    """JSON patch operations adding `safe-to-evict: "false"`: into the map when the copy shows
    one (the informer keeps an empty map for a pod whose annotations carve does not read), else
    the map itself, after a `test` that there is none (a null value tests a missing member):
    a map someone added meanwhile fails the patch, it is read again and the key added to it."""
    if PodView(pod).metadata.get("annotations") is not None:
        escaped = SAFE_TO_EVICT.replace("~", "~0").replace("/", "~1")  # RFC 6901
        return [{"op": "add", "path": f"/metadata/annotations/{escaped}", "value": "false"}]
    return [
        {"op": "test", "path": "/metadata/annotations", "value": None},
        {"op": "add", "path": "/metadata/annotations", "value": {SAFE_TO_EVICT: "false"}},
    ]


class GateGoneError(WriteSkippedError):
    """The pod no longer has carve's gate: a hint would land on a pod kube-scheduler owns."""
