"""What a pod needs from the controller now: one pure classification (`pod_work`).

Pure, so the queue logic is tested without threads or an apiserver; the reconciler keeps each
pod's classification (`controller.podqueue`) until the pod or one of its claims changes, and
visits only pods whose classification says there is something to do.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from controller.objects import (
    CarveClasses,
    handed_to_scheduler,
    is_allocated,
    is_carve_claim,
    key_of,
    other_gates,
    pod_claim_names,
)
from driver.apiviews import ObjectView, PodView
from driver.contract import DEFAULT_CONTRACT, Contract
from process.kube import Obj


class WorkKind(enum.Enum):
    NONE = "none"
    WAIT = "wait"
    UNGATE = "ungate"
    PLACE = "place"


@dataclass(frozen=True)
class PodWork:
    """What a pod needs from the controller now (computed from the pod and the claim store)."""

    kind: WorkKind
    claims: tuple[Obj, ...] = ()
    message: str = ""
    reason: str = "ClaimsNotReady"  # of a WAIT: the event/condition reason shown to the user
    # Of a WAIT: keys of the claims the pod names that the store does not hold: not created
    # yet, or another driver's (the controller keeps only carve's claims; `ClaimLookup`).
    missing: tuple[str, ...] = ()


GATED_ELSEWHERE = "SchedulingGatedElsewhere"
"""Reason of the wait for another scheduling gate (Kueue's admission, for one) to go."""


def pod_work(
    pod: Obj,
    claims: Mapping[str, Obj],
    classes: CarveClasses,
    contract: Contract = DEFAULT_CONTRACT,
    foreign_claims: Collection[str] = (),
) -> PodWork:
    """Classify one pod. Pure, so the queue logic is tested without threads or an apiserver.

    `claims` holds carve's claims only (`controller.cache.claim_view`); `foreign_claims` are
    the keys of claims known to exist and not to be carve's, so a claim the pod names that is
    in neither is one that does not exist yet, as far as the controller knows.

    Ungated pods are placed too when a carve claim of theirs is unallocated and was not handed
    to kube-scheduler: one that lost the allocation carve gave it (kube-scheduler's PostFilter
    cleared it), or one whose pod never had carve's gate (it escaped the admission policy: a
    template the policy had not seen yet, a namespace outside its selector). A gate cannot be
    added back, and only carve-controller may allocate carve's claims (the chart's
    carve-sole-allocator policy), so carve allocates them, ungated; not while another
    scheduling gate (a queue's) still holds the pod.
    """
    view = PodView(pod)
    gated = view.has_gate(contract.scheduling_gate)
    if view.terminal or view.node_name or view.deleting:
        return PodWork(WorkKind.NONE)
    others = other_gates(pod, contract.scheduling_gate) if gated else []
    if others:
        return PodWork(
            WorkKind.WAIT,
            message=f"waiting for scheduling gate {', '.join(others)} to be removed: "
            "carve places a pod only when its own gate is the last one",
            reason=GATED_ELSEWHERE,
        )
    names, missing = pod_claim_names(pod)
    if missing:
        if not gated:
            return PodWork(WorkKind.NONE)
        return PodWork(
            WorkKind.WAIT,
            message=f"waiting for kube-controller-manager to create claims for {sorted(missing)}",
        )
    ns = view.namespace
    carve: list[Obj] = []
    unknown: list[str] = []
    for name in names:
        claim = claims.get(f"{ns}/{name}")
        if claim is None:
            if f"{ns}/{name}" not in foreign_claims:
                unknown.append(f"{ns}/{name}")
            continue
        if is_carve_claim(claim, classes):
            carve.append(claim)
    if gated and unknown:
        return PodWork(
            WorkKind.WAIT,
            message=f"ResourceClaim {unknown[0]} does not exist",
            missing=tuple(unknown),
        )
    if gated:
        if not carve or all(is_allocated(c) for c in carve):
            return PodWork(WorkKind.UNGATE, tuple(carve))
        deleting = [key_of(c) for c in carve if ObjectView(c).deleting]
        if deleting:
            return PodWork(WorkKind.WAIT, message=f"ResourceClaim {deleting[0]} is being deleted")
        return PodWork(WorkKind.PLACE, tuple(carve))
    if view.scheduling_gates:
        return PodWork(WorkKind.NONE)  # not schedulable yet: its change wakes it
    unallocated = [c for c in carve if not is_allocated(c) and not handed_to_scheduler(c, contract)]
    if unallocated and not any(ObjectView(c).deleting for c in carve):
        return PodWork(WorkKind.PLACE, tuple(carve))
    return PodWork(WorkKind.NONE)


def may_need_work(pod: Obj, gate: str) -> bool:
    """False exactly when `pod_work` is NONE whatever the claims say: the pod ended, is bound,
    is being deleted, or has neither claims nor carve's gate."""
    view = PodView(pod)
    if view.terminal or view.node_name or view.deleting:
        return False
    return bool(view.resource_claims) or view.has_gate(gate)
