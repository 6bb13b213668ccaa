"""Writes the controller's decisions to the API: claim finalizer, `status.allocation`, gate removal.

An allocation (and its clearing) is a JSON merge patch of `status.allocation` that carries the
`resourceVersion` it was derived from, so the apiserver's optimistic concurrency protects it
against every other writer (kube-scheduler's PostFilter, a second controller that still
believes it leads). On a conflict the claim is read again and the patch is re-derived from the
fresh copy; when the fresh copy shows that the write no longer makes sense (claim already
allocated by someone else, claim gone) the mutation says so and nothing is written.

Removing carve's gate or a finalizer needs no such guard: only carve writes them, and the
resourceVersion turned every unrelated write to the object (kube-controller-manager records a
pod's claims in its status as carve ungates it) into a 409, a GET and a second PATCH. These are
JSON patches whose `test` operations pin what they depend on instead: the object's uid (not a
namesake) and the list element they remove, at the index the cached copy shows. A failed test
(422) means that list changed: the object is read once and the patch derived again. Adding the
finalizer (carve's admission policy normally does it at creation) is a strategic merge of the
finalizer list, a union, which needs no index; the uid in the patch pins the object.

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
from process.kube.errors import status_of
from process.kube.jsonclient import JsonRequests
from process.kube.rmw import (
    MERGE_PATCH,
    ObjectReplacedError,
    RetryPolicy,
    Target,
    WriteFencedError,
    is_transient,
    read_modify_write,
)

# Re-exported (the `as` form is mypy's explicit export): the reconciler catches what the writer
# raises without knowing that the read-modify-write edge defines it.
from process.kube.rmw import ObjectGoneError as ObjectGoneError  # noqa: PLC0414
from process.kube.rmw import WriteSkippedError as WriteSkippedError  # noqa: PLC0414

JSON_PATCH = "application/json-patch+json"
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

    def _rmw(
        self,
        obj: Obj,
        get: Callable[[str, str], Obj],
        patch: Callable[[str, str, Obj], Obj],
        mutate: Callable[[Obj], Obj | None],
    ) -> Obj:
        """Send the merge patch `mutate` derives from `obj` (an informer copy), guarded by its
        resourceVersion; on 409 re-read and derive again. None from `mutate`: no-op."""
        view = ObjectView(obj)
        name, namespace = view.name, view.namespace
        target = Target(
            namespace=namespace,
            name=name,
            uid=view.uid,
            read=lambda: get(name, namespace),
            write=lambda body: patch(name, namespace, body),
        )
        return read_modify_write(
            target,
            mutate,
            current=obj,
            fence=self._fence,
            policy=RetryPolicy(attempts=self._attempts),
        )

    def _edit(
        self,
        obj: Obj,
        get: Callable[[str, str], Obj],
        patch: Callable[[str, str, Any, str], Obj],
        ops: Callable[[Obj], list[Obj] | None],
    ) -> Obj:
        """Send the JSON patch `ops` derives from `obj` (an informer copy; None: nothing to
        do), pinned to the object's uid, without a resourceVersion (see the module). A failed
        `test` (422) or a transient error: read again and derive again, a bounded number of
        times."""
        view = ObjectView(obj)
        name, namespace, uid = view.name, view.namespace, view.uid
        current = obj
        for attempt in range(self._attempts):
            self._check_fence()
            body = ops(current)
            if body is None:
                return current
            try:
                return patch(
                    name,
                    namespace,
                    [{"op": "test", "path": "/metadata/uid", "value": uid}, *body],
                    JSON_PATCH,
                )
            except Exception as exc:
                if status_of(exc) == 404:
                    raise ObjectGoneError(f"{namespace}/{name} was deleted") from exc
                if (status_of(exc) != 422 and not is_transient(exc)) or (
                    attempt + 1 == self._attempts
                ):
                    raise
            current = self._reread(get, name, namespace, uid)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _reread(self, get: Callable[[str, str], Obj], name: str, namespace: str, uid: str) -> Obj:
        try:
            fresh = get(name, namespace)
        except Exception as exc:
            if status_of(exc) == 404:
                raise ObjectGoneError(f"{namespace}/{name} was deleted") from exc
            raise
        if ObjectView(fresh).uid != uid:
            raise ObjectReplacedError(f"object was replaced (uid {uid} is gone)")
        return fresh

    # -- claims ---------------------------------------------------------------------------------

    def _get_claim(self, name: str, namespace: str) -> Obj:
        return self._api.request("GET", _claim_path(namespace, name))

    def _patch_claim(self, name: str, namespace: str, body: Obj) -> Obj:
        return self._edit_claim(name, namespace, body, MERGE_PATCH)

    def _edit_claim(self, name: str, namespace: str, body: Any, content_type: str) -> Obj:
        return self._api.request(
            "PATCH", _claim_path(namespace, name), body=body, content_type=content_type
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
        creation); else a strategic merge of the list, which adds without replacing."""
        if has_finalizer(claim, self._finalizer):
            return claim
        view = ObjectView(claim)
        if view.deleting:
            raise WriteSkippedError("claim is being deleted")
        self._check_fence()
        name, namespace = view.name, view.namespace
        body = {"metadata": {"uid": view.uid, "finalizers": [self._finalizer]}}
        try:
            return self._edit_claim(name, namespace, body, STRATEGIC_MERGE)
        except Exception as exc:
            if status_of(exc) == 404:
                raise ObjectGoneError(f"{namespace}/{name} was deleted") from exc
            if status_of(exc) != 422:
                raise
            # A replaced claim (the uid is immutable) or one being deleted (no new finalizers).
            fresh = self._reread(self._get_claim, name, namespace, view.uid)
            if ObjectView(fresh).deleting:
                raise WriteSkippedError("claim is being deleted") from exc
            raise

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
        return self._edit(
            claim, self._get_claim, self._edit_claim, _removal("finalizers", self._finalizer)
        )

    def hand_to_scheduler(self, claim: Obj) -> Obj:
        """Leave an unallocated claim to kube-scheduler: drop our finalizer and mark it
        handed over (`Contract.allocator_annotation`), the one mark with which kube-scheduler
        may allocate a claim of carve's classes. Skipped once the claim is allocated."""
        marker = self._contract.allocator_annotation

        def mutate(cur: Obj) -> Obj | None:
            view = ClaimView(cur)
            if view.allocated:
                raise WriteSkippedError("claim was allocated meanwhile")
            marked = view.annotations.get(marker) == HANDED_TO_SCHEDULER
            if marked and not view.has_finalizer(self._finalizer):
                return None
            meta: Obj = {"annotations": {marker: HANDED_TO_SCHEDULER}}
            if view.has_finalizer(self._finalizer):
                meta["finalizers"] = [f for f in view.finalizers if f != self._finalizer]
            return {"metadata": meta}

        return self._rmw(claim, self._get_claim, self._patch_claim, mutate)

    def remove_node_finalizer(self, claim: Obj, finalizer: str) -> Obj:
        """Drop ``finalizer`` (a lost node's ``<driver>/node-<node>``) from the claim; only the
        finalizers list is patched, pinned as every removal is (see the module)."""
        if not self._contract.is_node_finalizer(finalizer):
            raise ValueError(f"{finalizer!r} is not a node finalizer of {self._contract.driver}")

        return self._edit(
            claim, self._get_claim, self._edit_claim, _removal("finalizers", finalizer)
        )

    # -- pods -----------------------------------------------------------------------------------

    def _get_pod(self, name: str, namespace: str) -> Obj:
        return self._api.request("GET", _pod_path(namespace, name))

    def _patch_pod(self, name: str, namespace: str, body: Obj) -> Obj:
        return self._edit_pod(name, namespace, body, MERGE_PATCH)

    def _edit_pod(self, name: str, namespace: str, body: Any, content_type: str) -> Obj:
        return self._api.request(
            "PATCH", _pod_path(namespace, name), body=body, content_type=content_type
        )

    def remove_gate(self, pod: Obj) -> Obj:
        return self._edit(
            pod, self._get_pod, self._edit_pod, _removal("schedulingGates", self._gate)
        )

    def pin_and_ungate(self, pod: Obj, node: str) -> Obj:
        def mutate(cur: Obj) -> Obj | None:
            if not has_gate(cur, self._gate):
                return None
            gates = [g for g in cur["spec"]["schedulingGates"] if g.get("name") != self._gate]
            return {"spec": {"affinity": pinned_affinity(cur, node), "schedulingGates": gates}}

        return self._rmw(pod, self._get_pod, self._patch_pod, mutate)

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


def _removal(field: str, name: str) -> Callable[[Obj], list[Obj] | None]:
    """JSON patch operations removing `name` from the finalizer list (`finalizers`) or the
    scheduling gates (`schedulingGates`), tested at the index where they are now."""
    parent = "metadata" if field == "finalizers" else "spec"

    def ops(cur: Obj) -> list[Obj] | None:
        entries = (cur.get(parent) or {}).get(field) or []
        for i, entry in enumerate(entries):
            value = entry if field == "finalizers" else entry.get("name")
            if value == name:
                path = f"/{parent}/{field}/{i}"
                test = path if field == "finalizers" else f"{path}/name"
                return [{"op": "test", "path": test, "value": name}, {"op": "remove", "path": path}]
        return None

    return ops


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
