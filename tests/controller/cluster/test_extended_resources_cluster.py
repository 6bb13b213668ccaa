"""Pods that ask through `resources.limits` (DRA extended resources) on the real control plane.

Real kube-apiserver, kube-scheduler and kube-controller-manager v1.37.2, the shipped
DeviceClasses (with `extendedResourceName`) and gate policies, carve-controller as a process.
Fake nodes publish ResourceSlices as the kubelet plugin does; no kubelet runs, so "runs" means
bound with its extended-resource claim allocated, and a test plays the kubelet by marking the
pod Succeeded.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.contract import EXTENDED_RESOURCE_CLAIM_ANNOTATION
from tests.controller.cluster.objects import (
    GATE_LABEL,
    claims_of,
    create_pod_when_policy_ready,
    events_for,
    profile_template,
    raw,
)
from tests.controller.cluster.objects import pod as claim_pod

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

H100 = "H100-SXM5-80GB"
MIG_3G = "nvidia.com/mig-3g.40gb"
CLASS_3G = "mig-3g-40gb.mig.carve.dev"


def ext_pod(name: str, limits: dict[str, str], *, gates: tuple[str, ...] = (), **extra: Any) -> Obj:
    spec: Obj = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/none",
                "resources": {"requests": {"cpu": "100m"}, "limits": dict(limits)},
            }
        ],
        "terminationGracePeriodSeconds": 0,
        **extra,
    }
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def read_pod(api: ApiClient, ns: str, name: str) -> Obj:
    return raw(client.CoreV1Api(api).read_namespaced_pod(name, ns, _preload_content=False))


def extended_claim(api: ApiClient, ns: str, pod_name: str) -> Obj | None:
    """The claim kube-scheduler created for the pod (named in its status)."""
    status = read_pod(api, ns, pod_name).get("status") or {}
    name = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if not name:
        return None
    return next((c for c in claims_of(api, ns) if c["metadata"]["name"] == name), None)


def allocated_on(claim: Obj) -> list[tuple[str, str]]:
    alloc = (claim.get("status") or {}).get("allocation") or {}
    return [(r["pool"], r["device"]) for r in alloc.get("devices", {}).get("results", [])]


def gate_namespace(api: ApiClient, ns: str) -> None:
    client.CoreV1Api(api).patch_namespace(ns, {"metadata": {"labels": {GATE_LABEL: "on"}}})


def test_the_scheduler_discards_an_extended_resource_claim_allocated_by_someone_else(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
) -> None:
    """The proof that kube-scheduler leaves an external allocator no room on this path.

    The pod is held by a foreign gate; an allocator then does everything the scheduler would:
    it creates the claim with the scheduler's annotation, the pod as controlling owner and the
    scheduler's request names, and writes its allocation. Once the gate goes, kube-scheduler
    finds that claim (it looks for exactly that annotation and owner), refuses every node
    ("cannot schedule extended resource claim": a found claim that has requests counts as
    stale), deletes it in PostFilter and allocates a claim of its own.
    """
    node = gpu_nodes([H100])
    core, res = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    created = raw(
        core.create_namespaced_pod(
            namespace,
            ext_pod("p", {MIG_3G: "1"}, gates=("carve.test/hold",)),
            _preload_content=False,
        )
    )
    slices = raw(
        res.list_resource_slice(field_selector=f"spec.nodeName={node}", _preload_content=False)
    )
    devices = [
        (s["spec"]["pool"]["name"], d["name"])
        for s in slices["items"]
        for d in s["spec"].get("devices") or []
        if "-mig-3g40gb-" in d["name"]
    ]
    assert len(devices) == 2, devices  # placements 0 and 4
    pool, device = devices[-1]
    ours = raw(
        res.create_namespaced_resource_claim(
            namespace,
            {
                "metadata": {
                    "generateName": "p-extended-resources-",
                    "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": "p",
                            "uid": created["metadata"]["uid"],
                            "controller": True,
                        }
                    ],
                },
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "container-0-request-0",
                                "exactly": {"deviceClassName": CLASS_3G, "count": 1},
                            }
                        ]
                    }
                },
            },
            _preload_content=False,
        )
    )
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    res.patch_namespaced_resource_claim_status(
        ours["metadata"]["name"],
        namespace,
        {
            "metadata": {"resourceVersion": ours["metadata"]["resourceVersion"]},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "container-0-request-0",
                                "driver": "mig.carve.dev",
                                "pool": pool,
                                "device": device,
                            }
                        ]
                    },
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    },
                    "allocationTimestamp": now,
                }
            },
        },
        _content_type="application/merge-patch+json",
    )
    core.patch_namespaced_pod(
        "p",
        namespace,
        {"spec": {"schedulingGates": None}},
        _content_type="application/merge-patch+json",
    )

    def ours_gone() -> bool:
        try:
            res.read_namespaced_resource_claim(ours["metadata"]["name"], namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for("kube-scheduler to delete the externally allocated claim", ours_gone, timeout=60)
    theirs = wait_for(
        "kube-scheduler's own claim", lambda: extended_claim(k8s_api, namespace, "p"), timeout=60
    )
    assert theirs["metadata"]["uid"] != ours["metadata"]["uid"]
    assert allocated_on(theirs), theirs
    # kube-scheduler writes its claim's allocation before it binds the pod.
    bound_to = wait_for(
        "the pod bound",
        lambda: read_pod(k8s_api, namespace, "p")["spec"].get("nodeName"),
        timeout=60,
    )
    assert bound_to == node
    notes = " ".join(
        str(e.get("note")) for e in events_for(k8s_api, namespace, "p") if e["type"] == "Warning"
    )
    print(f"ours {pool}/{device} deleted; scheduler allocated {allocated_on(theirs)}; {notes}")


def _bound_node(api: ApiClient, ns: str, name: str) -> str | None:
    node = read_pod(api, ns, name)["spec"].get("nodeName")
    return str(node) if node else None


def test_limits_pod_gets_carves_best_fit_where_native_first_fit_spreads(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
    gate_policies: None,
) -> None:
    """Two nodes with one H100 each; `busy` already holds a 3g.40gb (and CPU). Left to itself,
    kube-scheduler puts a `nvidia.com/mig-3g.40gb: 1` pod on the *empty* GPU (its scoring
    prefers the less loaded node; DRA adds no packing score), leaving two half-used GPUs and no
    room for a 7g.80gb. carve's best fit packs it next to the existing slice, so the other GPU
    stays whole and a 7g.80gb pod is placed there. Then the slice is released when the pod
    ends."""
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    busy = gpu_nodes([H100])
    empty = gpu_nodes([H100])
    carve("carve-a")
    res.create_namespaced_resource_claim_template(namespace, profile_template("t3g", "3g.40gb"))
    res.create_namespaced_resource_claim_template(namespace, profile_template("t7g", "7g.80gb"))
    gate_namespace(k8s_api, namespace)
    # The existing workload: a 3g.40gb claim pod with a large CPU request, placed by carve.
    create_pod_when_policy_ready(k8s_api, namespace, claim_pod("holder", "t3g", cpu="4"))
    holder_node = wait_for(
        "holder bound", lambda: _bound_node(k8s_api, namespace, "holder"), timeout=60
    )
    other = empty if holder_node == busy else busy

    # 1. The native path: the same ask in a pod that carve's gate did not catch.
    core.patch_namespace(namespace, {"metadata": {"labels": {GATE_LABEL: "off"}}})
    native = wait_for(
        "an ungated pod",
        lambda: _create_ungated(k8s_api, namespace, ext_pod("native", {MIG_3G: "1"})),
        timeout=40,
    )
    assert not native["spec"].get("schedulingGates")
    native_node = wait_for(
        "native bound", lambda: _bound_node(k8s_api, namespace, "native"), timeout=60
    )
    native_claim = wait_for(
        "native claim", lambda: extended_claim(k8s_api, namespace, "native"), timeout=30
    )
    print(f"native first fit: {native_node} {allocated_on(native_claim)} (holder on {holder_node})")
    assert native_node == other, "kube-scheduler packed by itself; the comparison shows nothing"
    core.delete_namespaced_pod("native", namespace, grace_period_seconds=0)
    wait_for(
        "the native claim to go",
        lambda: extended_claim_named(k8s_api, namespace, native_claim["metadata"]["name"]) is None,
        timeout=60,
    )

    # 2. The same pod through carve: gated at admission, pinned by best fit.
    gate_namespace(k8s_api, namespace)
    placed = wait_for(
        "a gated pod",
        lambda: _create_gated(k8s_api, namespace, ext_pod("limits", {MIG_3G: "1"})),
        timeout=40,
    )
    assert placed["spec"].get("schedulingGates")
    carve_node = wait_for(
        "limits bound", lambda: _bound_node(k8s_api, namespace, "limits"), timeout=60
    )
    ours = wait_for("its claim", lambda: extended_claim(k8s_api, namespace, "limits"), timeout=30)
    print(f"carve best fit: {carve_node} {allocated_on(ours)}")
    assert carve_node == holder_node
    assert ours["metadata"]["annotations"][EXTENDED_RESOURCE_CLAIM_ANNOTATION] == "true"
    (pool_device,) = allocated_on(ours)
    evs = wait_for(
        "the Placed event",
        lambda: [e for e in events_for(k8s_api, namespace, "limits") if e["reason"] == "Placed"],
    )
    assert holder_node in evs[0]["note"], evs
    # The whole GPU it kept free takes a 7g.80gb.
    core.create_namespaced_pod(namespace, claim_pod("big", "t7g"))
    assert (
        wait_for("big bound", lambda: _bound_node(k8s_api, namespace, "big"), timeout=60) == other
    )

    # 3. Release: the pod ends, its claim goes, the placement is free for the next ask.
    core.patch_namespaced_pod_status("limits", namespace, {"status": {"phase": "Succeeded"}})
    wait_for(
        "the claim released",
        lambda: (
            not allocated_on(
                extended_claim_named(k8s_api, namespace, ours["metadata"]["name"]) or {}
            )
        ),
        timeout=60,
    )
    _create_gated(k8s_api, namespace, ext_pod("again", {MIG_3G: "1"}))
    assert (
        wait_for("again bound", lambda: _bound_node(k8s_api, namespace, "again"), timeout=60)
        == holder_node
    )
    again = wait_for("its claim", lambda: extended_claim(k8s_api, namespace, "again"), timeout=30)
    assert allocated_on(again) == [pool_device]


def extended_claim_named(api: ApiClient, ns: str, name: str) -> Obj | None:
    return next((c for c in claims_of(api, ns) if c["metadata"]["name"] == name), None)


def _create_ungated(api: ApiClient, ns: str, body: Obj) -> Obj | None:
    """Create `body`; if the gate policy (still) caught it, delete it and say so (None)."""
    return _create_expecting(api, ns, body, gated=False)


def _create_gated(api: ApiClient, ns: str, body: Obj) -> Obj | None:
    return _create_expecting(api, ns, body, gated=True)


def _create_expecting(api: ApiClient, ns: str, body: Obj, *, gated: bool) -> Obj | None:
    """Namespace label changes reach the admission plugin through an informer: retry until the
    policy binding sees the namespace as the test set it."""
    core = client.CoreV1Api(api)
    created = raw(core.create_namespaced_pod(ns, body, _preload_content=False))
    if bool(created["spec"].get("schedulingGates")) == gated:
        return created
    core.delete_namespaced_pod(body["metadata"]["name"], ns, grace_period_seconds=0)
    wait_for(
        "the pod to go",
        lambda: body["metadata"]["name"] not in {p["metadata"]["name"] for p in _pods(api, ns)},
        timeout=30,
    )
    return None


def _pods(api: ApiClient, ns: str) -> list[Obj]:
    items: list[Obj] = raw(client.CoreV1Api(api).list_namespaced_pod(ns, _preload_content=False))[
        "items"
    ]
    return items


def test_asks_carve_cannot_place_get_a_reason_on_the_pod_and_a_pair_is_placed(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
    gate_policies: None,
) -> None:
    node = gpu_nodes([H100])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t1g", "1g.10gb"))
    gate_namespace(k8s_api, namespace)
    carve("carve-a")
    nowhere = ext_pod("nowhere", {"nvidia.com/mig-7g.141gb": "1"})  # an H200 profile
    create_pod_when_policy_ready(k8s_api, namespace, nowhere)
    mixed = ext_pod(
        "mixed", {MIG_3G: "1"}, resourceClaims=[{"name": "mig", "resourceClaimTemplateName": "t1g"}]
    )
    mixed["spec"]["containers"][0]["resources"]["claims"] = [{"name": "mig"}]
    core.create_namespaced_pod(namespace, mixed)
    init = ext_pod("init", {"cpu": "100m"})
    init["spec"]["initContainers"] = [
        {"name": "setup", "image": "registry.invalid/none", "resources": {"limits": {MIG_3G: "1"}}}
    ]
    core.create_namespaced_pod(namespace, init)
    core.create_namespaced_pod(namespace, ext_pod("pair", {"nvidia.com/mig-1g.10gb": "2"}))
    # A pod with its own required node affinity: carve's pin is added to the term (the
    # apiserver allows only narrowing a gated pod's terms).
    affine = ext_pod("affine", {"nvidia.com/mig-1g.10gb": "1"})
    own = {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}
    affine["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [own]}]
            }
        }
    }
    core.create_namespaced_pod(namespace, affine)

    def warning(name: str) -> Obj | None:
        evs = [e for e in events_for(k8s_api, namespace, name) if e["type"] == "Warning"]
        return evs[0] if evs else None

    seen = {
        n: wait_for(f"a reason on {n}", lambda n=n: warning(n), timeout=60)
        for n in ("nowhere", "mixed", "init")
    }
    for n, e in seen.items():
        print(f"{n}: {e['reason']}: {e['note']}")
    assert seen["nowhere"]["note"].startswith("nvidia.com/mig-7g.141gb of container main: ")
    assert "mig-7g-141gb.mig.carve.dev" in seen["nowhere"]["note"]
    assert seen["mixed"]["reason"] == "MixedClaimsAndExtendedResources"
    assert "also uses carve ResourceClaims" in seen["mixed"]["note"]
    assert seen["init"]["reason"] == "InvalidExtendedResourceRequest"
    assert "init container setup" in seen["init"]["note"]
    for n in seen:
        # The event and the condition are written beside the decision thread, in no set order.
        def placed_condition(name: str = n) -> Any:
            conditions = read_pod(k8s_api, namespace, name)["status"].get("conditions") or []
            return next((c for c in conditions if c["type"] == "mig.carve.dev/Placed"), None)

        cond = wait_for(f"{n}'s Placed condition", placed_condition, timeout=30)
        assert read_pod(k8s_api, namespace, n)["spec"].get("schedulingGates"), f"{n} lost its gate"
        assert cond["status"] == "False" and cond["reason"] == seen[n]["reason"]
    assert (
        wait_for("pair bound", lambda: _bound_node(k8s_api, namespace, "pair"), timeout=60) == node
    )
    pair = wait_for("its claim", lambda: extended_claim(k8s_api, namespace, "pair"), timeout=30)
    assert len(set(allocated_on(pair))) == 2
    assert wait_for("affine bound", lambda: _bound_node(k8s_api, namespace, "affine")) == node
    (term,) = read_pod(k8s_api, namespace, "affine")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [own]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [node]}]
