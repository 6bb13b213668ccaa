"""Writes the controller's decisions to the API: claim finalizer, `status.allocation`, gate removal.

An allocation (and its clearing) is a JSON merge patch of `status.allocation` that carries the
`resourceVersion` it was derived from, so the apiserver's optimistic concurrency protects it
against every other writer (kube-scheduler's PostFilter, a second controller that still
believes it leads). On a conflict the claim is read again and the patch is re-derived from the
fresh copy; when the fresh copy shows that the write no longer makes sense (claim already
allocated by someone else, claim gone) the mutation says so and nothing is written.

Finalizers and carve's scheduling gate need no such guard: each write touches only carve's own
entry, and the resourceVersion turned every unrelated write to the object (kube-controller-manager
records a pod's claims in its status as carve ungates it) into a 409, a GET and a second PATCH.
Finalizers are added and removed as `process.kube.finalizers` does it for both programs (a
strategic merge that adds one entry; a JSON patch that tests the entry at its index and removes
it); the gate is removed the same way. The hand-over to kube-scheduler removes the finalizer with
those same operations, in one JSON patch with its annotation and a `test` of the resourceVersion:
it must land only on a claim still unallocated.

Never a PUT of the whole object: the apiserver keeps opaque config parameters as the bytes it
received and compares those bytes when it checks that an immutable spec did not change. A
claim read and written back re-serialises them (other spacing, other number spelling), and the
apiserver refuses that as a spec change. A patch leaves every field carve does not own as the
server has it.

The allocation itself is built by a pure function (`build_allocation_status`) so that its shape
(results, config, nodeSelector, timestamp) is tested without an apiserver.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from controller.autoscaling import (
    SAFE_TO_EVICT,
    hint_of,
    hint_ops,
    protection_ops,
    reset_ops,
    scheduled_pin,
    wants_protection,
)
from controller.extended_resources import pinned_affinity
from controller.objects import ClaimAllocation, has_finalizer, has_gate, node_finalizers
from driver.allocation import (
    AllocationFormatError,
    canonical_json,
    parse_allocation,
    result_json,
)
from driver.apiviews import ClaimView, DeviceClassView, ObjectView
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER, Contract
from process.kube import Obj
from process.kube.finalizers import FinalizedObject, add_finalizer, removal, remove_finalizer
from process.kube.jsonclient import JsonRequests
from process.kube.rmw import (
    JSON_PATCH,
    MERGE_PATCH,
    RetryPolicy,
    Target,
    WriteFencedError,
    edit_pinned,
    read_modify_write,
)

# Re-exported (the `as` form is mypy's explicit export): the reconciler catches what the writer
# raises without knowing that the read-modify-write edge defines it.
from process.kube.rmw import ObjectGoneError as ObjectGoneError  # noqa: PLC0414
from process.kube.rmw import WriteSkippedError as WriteSkippedError  # noqa: PLC0414

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


def node_selector_for(node: str) -> Obj:
    """The selector kube-scheduler writes for node-local devices: a field match on the name."""
    return {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }


def _rfc3339(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def request_class(claim: Obj, request: str) -> Obj | None:
    """The exact request (or firstAvailable subrequest) that a result names, or None."""
    main, _, sub = request.partition("/")
    for req in ClaimView(claim).requests:
        if req.get("name") != main:
            continue
        if not sub:
            exact = req.get("exactly")
            return exact if isinstance(exact, dict) else None
        for subreq in req.get("firstAvailable") or []:
            if isinstance(subreq, Mapping) and subreq.get("name") == sub:
                return subreq if isinstance(subreq, dict) else None
    return None


def build_allocation_status(
    claim: Obj,
    allocation: ClaimAllocation,
    classes: Mapping[str, Obj],
    now: dt.datetime,
) -> Obj:
    """The `status.allocation` object for a claim, shaped as kube-scheduler's allocator shapes it.

    Opaque config is copied here (class config as `FromClass`, claim config as `FromClaim`) because
    the kubelet plugin reads only the allocation, never the class: a class edited after allocation
    must not change what an already allocated claim gets.
    """
    results: list[Obj] = []
    config: list[Obj] = []
    for res in allocation.results:
        # What a result carries besides the device comes from the request it satisfies.
        wanted = request_class(claim, res.request) or {}
        tolerations = wanted.get("tolerations")
        results.append(
            result_json(
                replace(
                    res,
                    tolerations_json=canonical_json(tolerations) if tolerations else "",
                    admin_access=bool(wanted.get("adminAccess")),
                )
            )
        )
    seen_requests: set[str] = set()
    for res in allocation.results:
        if res.request in seen_requests:
            continue
        seen_requests.add(res.request)
        req = request_class(claim, res.request)
        cls = classes.get(str(req.get("deviceClassName", ""))) if req is not None else None
        for cfg in DeviceClassView(cls).config if cls is not None else ():
            if "opaque" in cfg:
                config.append(
                    {
                        "source": "FromClass",
                        "requests": [res.request],
                        "opaque": copy.deepcopy(cfg["opaque"]),
                    }
                )
    for cfg in ClaimView(claim).config:
        if "opaque" in cfg:
            entry = {"source": "FromClaim", "opaque": copy.deepcopy(cfg["opaque"])}
            if cfg.get("requests"):
                entry["requests"] = list(cfg["requests"])
            config.append(entry)
    devices: Obj = {"results": results}
    if config:
        devices["config"] = config
    return {
        "devices": devices,
        "nodeSelector": node_selector_for(allocation.node),
        "allocationTimestamp": _rfc3339(now),
    }


def _claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


class KubeClaimWriter:
    """`ClaimWriter` against the apiserver through the JSON client (resource.k8s.io/v1, core/v1):
    the one client whose requests are counted and whose refusals are `process.kube.errors`.

    `fence` is consulted before every write: a controller that lost its lease must stop writing
    at once, even in the middle of a retry loop.
    """

    def __init__(
        self,
        api: JsonRequests,
        *,
        contract: Contract = DEFAULT_CONTRACT,
        fence: Callable[[], bool] = lambda: True,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        attempts: int = 8,
    ) -> None:
        self._api = api
        self._contract = contract
        self._finalizer = contract.allocation_finalizer
        self._gate = contract.scheduling_gate
        self._fence = fence
        self._clock = clock
        self._attempts = attempts

    # -- read-modify-write (process.rmw) ------------------------------------------------------

    def _check_fence(self) -> None:
        if not self._fence():
            raise WriteFencedError("not the leader any more")

    def _target(
        self, obj: Obj, get: Callable[[str, str], Obj], patch: Callable[[str, str, Any], Obj]
    ) -> Target:
        view = ObjectView(obj)
        name, namespace = view.name, view.namespace
        return Target(
            namespace=namespace,
            name=name,
            uid=view.uid,
            read=lambda: get(name, namespace),
            write=lambda body: patch(name, namespace, body),
        )

    def _rmw(
        self,
        obj: Obj,
        get: Callable[[str, str], Obj],
        patch: Callable[[str, str, Obj], Obj],
        mutate: Callable[[Obj], Obj | None],
    ) -> Obj:
        """Send the merge patch `mutate` derives from `obj` (an informer copy), guarded by its
        resourceVersion; on 409 re-read and derive again. None from `mutate`: no-op."""
        return read_modify_write(
            self._target(obj, get, patch),
            mutate,
            current=obj,
            fence=self._fence,
            policy=RetryPolicy(attempts=self._attempts),
        )

    def _pinned(
        self,
        obj: Obj,
        get: Callable[[str, str], Obj],
        patch: Callable[[str, str, Any], Obj],
        ops: Callable[[Obj], list[Obj] | None],
    ) -> Obj:
        """Send the JSON patch `ops` derives from `obj` (an informer copy; None: nothing to
        do), pinned by its `test` operations (see the module); on 422 re-read and derive again."""
        return edit_pinned(
            self._target(obj, get, patch),
            ops,
            current=obj,
            fence=self._fence,
            policy=RetryPolicy(attempts=self._attempts),
        )

    def _claim(self, claim: Obj) -> FinalizedObject:
        view = ObjectView(claim)
        return FinalizedObject(
            self._api,
            _claim_path(view.namespace, view.name),
            view.namespace,
            view.name,
            view.uid,
            fence=self._fence,
            policy=RetryPolicy(attempts=self._attempts),
        )

    # -- claims ---------------------------------------------------------------------------------

    def _get_claim(self, name: str, namespace: str) -> Obj:
        return self._api.request("GET", _claim_path(namespace, name))

    def _json_patch_claim(self, name: str, namespace: str, ops: Any) -> Obj:
        return self._api.request(
            "PATCH", _claim_path(namespace, name), body=ops, content_type=JSON_PATCH
        )

    def _patch_claim_status(self, name: str, namespace: str, body: Obj) -> Obj:
        return self._api.request(
            "PATCH", f"{_claim_path(namespace, name)}/status", body=body, content_type=MERGE_PATCH
        )

    def read_claim(self, claim: Obj) -> Obj:
        view = ObjectView(claim)
        return self._get_claim(view.name, view.namespace)

    def add_finalizer(self, claim: Obj) -> Obj:
        """Nothing to send when the claim has it (carve's admission policy adds it at
        creation); else `process.kube.finalizers.add_finalizer`."""
        return add_finalizer(self._claim(claim), self._finalizer, current=claim)

    def write_allocation(
        self, claim: Obj, allocation: ClaimAllocation, classes: Mapping[str, Obj]
    ) -> Obj:
        def mutate(cur: Obj) -> Obj | None:
            status = cur.setdefault("status", {})
            if status.get("allocation"):
                if _allocation_matches(status["allocation"], allocation):
                    return None
                raise WriteSkippedError("claim was allocated by someone else meanwhile")
            if ObjectView(cur).deleting:
                raise WriteSkippedError("claim is being deleted")
            if not has_finalizer(cur, self._finalizer):
                raise WriteSkippedError("claim lost the controller finalizer")
            built = build_allocation_status(cur, allocation, classes, self._clock())
            return {"status": {"allocation": built}}

        return self._rmw(claim, self._get_claim, self._patch_claim_status, mutate)

    def clear_allocation(self, claim: Obj) -> Obj:
        """Free the claim's placement. Decided on a cached copy, so each attempt checks the
        fresh one again: a node finalizer added meanwhile (its plugin is preparing the claim)
        means the node has not confirmed a teardown, and clearing now would free a placement
        whose instance is being made (invariant 4)."""

        def mutate(cur: Obj) -> Obj | None:
            status = cur.setdefault("status", {})
            if status.get("reservedFor"):
                raise WriteSkippedError("claim is reserved again")
            nodes = node_finalizers(cur, self._contract)
            if nodes:
                raise WriteSkippedError(f"a node is preparing the claim meanwhile ({nodes[0]})")
            if not status.get("allocation"):
                return None
            return {"status": {"allocation": None, "devices": None}}

        return self._rmw(claim, self._get_claim, self._patch_claim_status, mutate)

    def remove_finalizer(self, claim: Obj) -> Obj:
        return remove_finalizer(self._claim(claim), self._finalizer, current=claim)

    def hand_to_scheduler(self, claim: Obj) -> Obj:
        """Leave an unallocated claim to kube-scheduler: drop our finalizer and mark it
        handed over (`Contract.allocator_annotation`), the one mark with which kube-scheduler
        may allocate a claim of carve's classes. Skipped once the claim is allocated: the
        patch tests the resourceVersion it was derived from (see the module)."""
        marker = self._contract.allocator_annotation

        def ops(cur: Obj) -> list[Obj] | None:
            view = ClaimView(cur)
            if view.allocated:
                raise WriteSkippedError("claim was allocated meanwhile")
            unfinalized = removal(cur, self._finalizer) or []
            if view.annotations.get(marker) == HANDED_TO_SCHEDULER and not unfinalized:
                return None
            version = view.metadata.get("resourceVersion")
            test = {"op": "test", "path": "/metadata/resourceVersion", "value": version}
            return [test, _annotation(cur, marker, HANDED_TO_SCHEDULER), *unfinalized]

        return self._pinned(claim, self._get_claim, self._json_patch_claim, ops)

    def remove_node_finalizer(self, claim: Obj, finalizer: str) -> Obj:
        """Drop ``finalizer`` (a lost node's ``<driver>/node-<node>``) from the claim, as the
        node itself would (`process.kube.finalizers`)."""
        if not self._contract.is_node_finalizer(finalizer):
            raise ValueError(f"{finalizer!r} is not a node finalizer of {self._contract.driver}")
        return remove_finalizer(self._claim(claim), finalizer, current=claim)

    # -- pods -----------------------------------------------------------------------------------

    def _get_pod(self, name: str, namespace: str) -> Obj:
        return self._api.request("GET", _pod_path(namespace, name))

    def _patch_pod(self, name: str, namespace: str, body: Obj) -> Obj:
        return self._api.request(
            "PATCH", _pod_path(namespace, name), body=body, content_type=MERGE_PATCH
        )

    def _edit_pod(self, name: str, namespace: str, ops: Any) -> Obj:
        return self._api.request(
            "PATCH", _pod_path(namespace, name), body=ops, content_type=JSON_PATCH
        )

    def _edit_pod_status(self, name: str, namespace: str, ops: Any) -> Obj:
        return self._api.request(
            "PATCH", f"{_pod_path(namespace, name)}/status", body=ops, content_type=JSON_PATCH
        )

    def remove_gate(self, pod: Obj, *, protect: bool = False) -> Obj:
        """Remove carve's gate (a JSON patch that tests the entry at its index). carve's
        Unschedulable hint is reset first (`controller.autoscaling`): the patch also tests the
        `PodScheduled` reason it was derived under, so a hint that landed meanwhile fails it and
        is reset before the gate goes. `protect`: the pod will hold a live slice, so mark it
        not safe to evict unless it is opted in as movable or its user set the annotation."""

        def ops(cur: Obj) -> list[Obj] | None:
            for i, gate in enumerate((cur.get("spec") or {}).get("schedulingGates") or []):
                if gate.get("name") == self._gate:
                    if hint_of(cur, self._gate) is not None:
                        raise _HintFirstError(cur)
                    path = f"/spec/schedulingGates/{i}"
                    test = {"op": "test", "path": f"{path}/name", "value": self._gate}
                    out = [test, *scheduled_pin(cur), {"op": "remove", "path": path}]
                    if protect and wants_protection(cur, self._contract):
                        out += protection_ops(cur)
                    return out
            return None

        return self._ungate(pod, lambda cur: self._pinned(cur, self._get_pod, self._edit_pod, ops))

    def _ungate(self, pod: Obj, write: Callable[[Obj], Obj]) -> Obj:
        """`write(pod)`, after resetting carve's hint each time `write` finds one."""
        current = pod
        for _ in range(self._attempts):
            try:
                return write(current)
            except _HintFirstError as first:
                current = self.reset_unschedulable(first.pod)
        raise WriteSkippedError("carve's Unschedulable hint came back on every attempt")

    def pin_and_ungate(self, pod: Obj, node: str) -> Obj:
        """Pin the pod to `node` and remove the gate in one merge patch (guarded by the
        resourceVersion, so a hint that landed meanwhile makes it conflict and is reset
        first); the pod will hold a slice there, so it is marked not safe to evict as
        `remove_gate` marks it."""

        def mutate(cur: Obj) -> Obj | None:
            if not has_gate(cur, self._gate):
                return None
            if hint_of(cur, self._gate) is not None:
                raise _HintFirstError(cur)
            gates = [g for g in cur["spec"]["schedulingGates"] if g.get("name") != self._gate]
            patch: Obj = {
                "spec": {"affinity": pinned_affinity(cur, node), "schedulingGates": gates}
            }
            if wants_protection(cur, self._contract):
                patch["metadata"] = {"annotations": {SAFE_TO_EVICT: "false"}}
            return patch

        return self._ungate(pod, lambda cur: self._rmw(cur, self._get_pod, self._patch_pod, mutate))

    def set_unschedulable(self, pod: Obj, message: str) -> Obj:
        """carve's hint for Cluster Autoscaler (`controller.autoscaling`): `PodScheduled`
        False, reason Unschedulable, with `message`. A JSON patch of the pod's status pinned on
        carve's gate: it never lands on a pod carve has ungated (`GateGoneError` instead)."""
        now = self._clock()
        return self._pinned(
            pod,
            self._get_pod,
            self._edit_pod_status,
            lambda cur: hint_ops(cur, self._gate, message, now),
        )

    def reset_unschedulable(self, pod: Obj) -> Obj:
        """Turn carve's hint back into the apiserver's `SchedulingGated`; no request when the
        pod shows no hint. Returns the pod as written (or the copy given)."""
        now = self._clock()
        return self._pinned(
            pod, self._get_pod, self._edit_pod_status, lambda cur: reset_ops(cur, self._gate, now)
        )

    def set_pod_condition(self, pod: Obj, status: bool, reason: str, message: str) -> None:
        """Record carve's verdict in the pod's conditions (`kubectl describe pod` shows it).

        A strategic-merge patch keyed by condition type: it neither races with the kubelet's or
        the scheduler's own conditions nor needs a resourceVersion.
        """
        self._check_fence()
        view = ObjectView(pod)
        cond = pod_condition(self._contract, status, reason, message, self._clock())
        self._api.request(
            "PATCH",
            f"{_pod_path(view.namespace, view.name)}/status",
            body={"status": {"conditions": [cond]}},
            content_type=STRATEGIC_MERGE,
        )


class _HintFirstError(Exception):
    """A gate removal found carve's hint on the pod: reset it, then remove the gate."""

    def __init__(self, pod: Obj) -> None:
        super().__init__("carve's Unschedulable hint is still on the pod")
        self.pod = pod


def _annotation(obj: Obj, key: str, value: str) -> Obj:
    """The JSON patch operation that sets one annotation (the map itself when there is none)."""
    if ObjectView(obj).metadata.get("annotations") is None:
        return {"op": "add", "path": "/metadata/annotations", "value": {key: value}}
    escaped = key.replace("~", "~0").replace("/", "~1")  # RFC 6901
    return {"op": "add", "path": f"/metadata/annotations/{escaped}", "value": value}


def pod_condition(
    contract: Contract, status: bool, reason: str, message: str, now: dt.datetime
) -> Obj:
    return {
        "type": contract.placed_condition,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": _rfc3339(now),
    }


def _allocation_matches(existing: Obj, wanted: ClaimAllocation) -> bool:
    """True when `existing` is the allocation we meant to write (a retry after a lost response)."""
    try:
        results = parse_allocation(existing).results
    except AllocationFormatError:
        return False  # not what carve writes, so not ours
    have = sorted(r.sort_key() for r in results)
    want = sorted(r.sort_key() for r in wanted.results)
    return have == want and existing.get("nodeSelector") == node_selector_for(wanted.node)
