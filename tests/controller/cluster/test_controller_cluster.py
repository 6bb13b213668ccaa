"""carve-controller as a real process with the real kube-scheduler and kube-controller-manager.

Fake nodes publish ResourceSlices built by driver.resourceslice (as the kubelet plugin does);
pods reference ResourceClaimTemplates, so KCM creates the claims; the controller allocates and
ungates; kube-scheduler binds to the allocated node. No kubelet runs, so pods stay Pending after
binding. (Release after a pod ends is proven in process, tests/controller/test_reconciler.py,
and end to end with a node that confirms, tests/e2e/test_scenarios.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from controller.autoscaling import HINT_PREFIX
from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from tests.controller.cluster.objects import (
    GATE_LABEL,
    allocated_devices,
    claims_of,
    create_pod_when_policy_ready,
    ensure_cluster_object,
    events_for,
    load_manifests,
    pod,
    pods_of,
    profile_template,
    raw,
    template,
)
from tests.support.controller_cluster import ControllerProcess, assert_consistent, bound_pods

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_gated_pods_are_placed_and_bound_and_overflow_waits_with_reason(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    nodes = {gpu_nodes(["A100-SXM4-40GB"]), gpu_nodes(["A100-SXM4-40GB"])}
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t3g", "3g.20gb"))
    carve("carve-a")
    for i in range(5):
        core.create_namespaced_pod(namespace, pod(f"p{i}", "t3g"))
    bound = wait_for("4 pods bound", lambda: len(bound_pods(k8s_api, namespace)) == 4, timeout=60)
    assert bound
    assert {p["spec"]["nodeName"] for p in bound_pods(k8s_api, namespace)} == nodes
    assert_consistent(k8s_api, namespace)
    waiting = [p for p in pods_of(k8s_api, namespace) if not p["spec"].get("nodeName")]
    assert len(waiting) == 1
    name = waiting[0]["metadata"]["name"]
    assert waiting[0]["spec"].get("schedulingGates")
    evs = wait_for("a waiting event", lambda: events_for(k8s_api, namespace, name))
    assert evs[0]["type"] == "Warning"
    assert "3g.20gb" in evs[0]["note"]
    # The condition is written beside the decision, and kube-scheduler's PodScheduled may be
    # the only condition listed when it is not there yet.
    conds = wait_for(
        "the Placed condition",
        lambda: {
            c["type"]: c
            for c in raw(core.read_namespaced_pod(name, namespace, _preload_content=False))[
                "status"
            ].get("conditions")
            or []
        },
        until=lambda by_type: "mig.carve.dev/Placed" in by_type,
    )
    placed_cond = conds["mig.carve.dev/Placed"]
    assert placed_cond["status"] == "False"
    assert "3g.20gb" in placed_cond["message"]
    # The waiting pod's claim says why too; a placed pod's claim carries no event (its
    # allocation says it) but the finalizer carve's admission policy gave it at creation.
    mine = next(
        c for c in claims_of(k8s_api, namespace) if not (c.get("status") or {}).get("allocation")
    )
    told = wait_for(
        "the claim's event", lambda: events_for(k8s_api, namespace, mine["metadata"]["name"])
    )
    assert told[0]["type"] == "Warning" and "3g.20gb" in told[0]["note"]
    placed = [c for c in claims_of(k8s_api, namespace) if (c.get("status") or {}).get("allocation")]
    assert all(not events_for(k8s_api, namespace, c["metadata"]["name"]) for c in placed)
    assert all("mig.carve.dev/allocation" in c["metadata"]["finalizers"] for c in placed)
    first = bound_pods(k8s_api, namespace)[0]
    # The Placed event is written beside the placement: the pod may be bound before it lands.
    carve_told = wait_for(
        f"carve's event on {first['metadata']['name']}",
        lambda: [
            e["reason"]
            for e in events_for(k8s_api, namespace, first["metadata"]["name"])
            if e["reason"] != "Scheduled"  # kube-scheduler's binding
        ],
        timeout=30,
    )
    assert carve_told == ["Placed"], "one event for a pod placed at once, and no condition"
    assert "mig.carve.dev/Placed" not in {
        c["type"] for c in (first.get("status") or {}).get("conditions") or []
    }
    # Once there is room the waiting pod is placed, and its condition turns True.
    core.delete_namespaced_pod(first["metadata"]["name"], namespace, grace_period_seconds=0)

    def placed_condition() -> str:
        now = raw(core.read_namespaced_pod(name, namespace, _preload_content=False))
        by_type = {c["type"]: c for c in (now.get("status") or {}).get("conditions") or []}
        return str(by_type.get("mig.carve.dev/Placed", {}).get("status", ""))

    wait_for(
        "the waiting pod's condition to turn True", lambda: placed_condition() == "True", timeout=60
    )


def test_killed_leader_fails_over_without_double_allocation(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    for _ in range(2):
        gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t1g", "1g.5gb"))
    for i in range(6):
        core.create_namespaced_pod(namespace, pod(f"p{i:02d}", "t1g"))
    replicas = {"carve-a": carve("carve-a"), "carve-b": carve("carve-b")}
    wait_for(
        "the first allocations",
        lambda: len(allocated_devices(claims_of(k8s_api, namespace))) >= 2,
        timeout=60,
    )
    coord = client.CoordinationV1Api(k8s_api)
    lease = raw(coord.read_namespaced_lease("carve-controller", namespace, _preload_content=False))
    leader = lease["spec"]["holderIdentity"]
    replicas[leader].kill()
    # Pods created after the kill can only be placed by the standby, once the dead leader's
    # lease expires: the leader may well have placed all of the first six before it died.
    for i in range(6, 12):
        core.create_namespaced_pod(namespace, pod(f"p{i:02d}", "t1g"))
    wait_for("all 12 pods bound", lambda: len(bound_pods(k8s_api, namespace)) == 12, timeout=90)
    assert_consistent(k8s_api, namespace)
    lease = raw(coord.read_namespaced_lease("carve-controller", namespace, _preload_content=False))
    assert lease["spec"]["holderIdentity"] != leader
    assert lease["spec"]["leaseTransitions"] >= 1


def test_bad_claims_get_clear_events_while_others_are_placed(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    bad = {
        "unknown-class": template("unknown-class", cls="9g.mig.carve.dev"),
        "impossible": profile_template("impossible", "5g.99gb"),
        "cel-error": template("cel-error", 'device.attributes["mig.carve.dev"].nosuch == 1'),
        "too-many": profile_template("too-many", "1g.5gb", count=8),
    }
    for t in bad.values():
        res.create_namespaced_resource_claim_template(namespace, t)
    res.create_namespaced_resource_claim_template(namespace, profile_template("good", "2g.10gb"))
    for name in bad:
        core.create_namespaced_pod(namespace, pod(f"bad-{name}", name))
    core.create_namespaced_pod(namespace, pod("good-pod", "good"))
    carve("carve-a")
    wait_for(
        "the good pod bound",
        lambda: any(p["metadata"]["name"] == "good-pod" for p in bound_pods(k8s_api, namespace)),
        timeout=60,
    )
    notes = {}
    for name in bad:
        evs = wait_for(
            f"an event for bad-{name}", lambda n=name: events_for(k8s_api, namespace, f"bad-{n}")
        )
        assert evs[0]["type"] == "Warning"
        notes[name] = evs[0]["note"]
    assert "9g.mig.carve.dev" in notes["unknown-class"]
    assert "does not exist" in notes["unknown-class"]
    assert "nosuch" in notes["cel-error"]
    assert "5g.99gb" in notes["impossible"] or "no " in notes["impossible"].lower()
    for name in bad:
        p = raw(core.read_namespaced_pod(f"bad-{name}", namespace, _preload_content=False))
        assert p["spec"].get("schedulingGates"), f"bad-{name} lost its gate"
    assert_consistent(k8s_api, namespace)
    print({k: v for k, v in notes.items()})


def test_conflict_storm_on_claims_and_pods_still_places_everything_once(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    """Another writer keeps bumping every claim's and pod's resourceVersion while carve works."""
    import threading

    gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t", "1g.5gb"))
    for i in range(7):
        core.create_namespaced_pod(namespace, pod(f"p{i}", "t"))
    stop = threading.Event()
    bumps = [0]

    def storm() -> None:
        while not stop.is_set():
            for c in claims_of(k8s_api, namespace):
                try:
                    res.patch_namespaced_resource_claim(
                        c["metadata"]["name"],
                        namespace,
                        {"metadata": {"annotations": {"storm": str(bumps[0])}}},
                    )
                    core.patch_namespaced_pod(
                        c["metadata"]["name"].rsplit("-", 2)[0],
                        namespace,
                        {"metadata": {"annotations": {"storm": str(bumps[0])}}},
                    )
                    bumps[0] += 1
                except client.exceptions.ApiException:
                    pass

    t = threading.Thread(target=storm, daemon=True)
    t.start()
    try:
        carve("carve-a")
        wait_for("all 7 pods bound", lambda: len(bound_pods(k8s_api, namespace)) == 7, timeout=90)
    finally:
        stop.set()
        t.join(10)
    assert bumps[0] > 20
    assert_consistent(k8s_api, namespace)


def test_native_fallback_hands_unplaceable_pods_to_kube_scheduler(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(
        namespace, profile_template("huge", "1g.5gb", count=8)
    )
    core.create_namespaced_pod(namespace, pod("huge-pod", "huge"))
    carve("carve-a", "--native-fallback-after", "3s")

    def ungated() -> bool:
        p = raw(core.read_namespaced_pod("huge-pod", namespace, _preload_content=False))
        return not p["spec"].get("schedulingGates")

    wait_for("the pod to be handed to kube-scheduler", ungated, timeout=60)
    # The event is written beside the gate's removal, by the controller's event writer.
    wait_for(
        "the HandedToScheduler event on huge-pod",
        lambda: [e["reason"] for e in events_for(k8s_api, namespace, "huge-pod")],
        until=lambda reasons: "HandedToScheduler" in reasons,
        timeout=30,
    )

    def scheduler_verdict() -> str | None:
        p = raw(core.read_namespaced_pod("huge-pod", namespace, _preload_content=False))
        for c in (p.get("status") or {}).get("conditions") or []:
            if (
                c["type"] == "PodScheduled"
                and c["status"] == "False"
                and c.get("reason") == "Unschedulable"
                # kube-scheduler's own, not the hint carve wrote while it kept the gate
                and not str(c.get("message")).startswith(HINT_PREFIX)
            ):
                return str(c.get("message"))
        return None

    # kube-scheduler now owns the pod; it cannot fit 8 slices on a 7-slice GPU either, and says
    # so in the form Cluster Autoscaler acts on (docs/guide/autoscaling.md).
    assert wait_for("kube-scheduler's verdict", scheduler_verdict, timeout=60)
    (claim,) = claims_of(k8s_api, namespace)
    assert "mig.carve.dev/allocation" not in (claim["metadata"].get("finalizers") or [])
    assert not (claim.get("status") or {}).get("allocation")


def test_pods_gated_by_the_shipped_policy_are_placed(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
    gate_policies: None,
) -> None:
    """The whole flow: admission gates the pod, the controller places it, the scheduler binds."""
    core = client.CoreV1Api(k8s_api)
    core.patch_namespace(namespace, {"metadata": {"labels": {GATE_LABEL: "on"}}})
    node = gpu_nodes(["A100-SXM4-40GB"])
    res = client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t", "2g.10gb"))
    carve("carve-a")
    body = pod("admitted", "t", gated=False)
    created = create_pod_when_policy_ready(k8s_api, namespace, body)
    assert [g["name"] for g in created["spec"]["schedulingGates"]] == ["mig.carve.dev/placement"]
    bound = wait_for(
        "the admitted pod bound",
        lambda: [p for p in bound_pods(k8s_api, namespace) if p["metadata"]["name"] == "admitted"],
        timeout=60,
    )
    assert bound[0]["spec"]["nodeName"] == node
    assert_consistent(k8s_api, namespace)


def test_controller_runs_with_only_the_shipped_rbac(
    k8s_cluster: LocalCluster,
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    tmp_path: Path,
) -> None:
    """deploy/manifests/20-rbac-controller.yaml is enough: binding subresource, finalizers,
    gate removal, events, the Lease. The controller authenticates as its ServiceAccount."""
    from kubernetes import utils
    from kubernetes.utils import FailToCreateError

    core = client.CoreV1Api(k8s_api)
    try:
        core.create_namespace({"metadata": {"name": "carve-system"}})
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(k8s_api, obj)
    for obj in load_manifests("20-rbac-controller.yaml"):
        try:
            utils.create_from_dict(k8s_api, obj)
        except FailToCreateError as exc:
            if any(e.status != 409 for e in exc.api_exceptions):
                raise
    user = "system:serviceaccount:carve-system:carve-controller"
    client_for_user = k8s_cluster.client_for_user(
        user, ("system:serviceaccounts", "system:serviceaccounts:carve-system")
    )
    del client_for_user  # only its kubeconfig file is needed
    kubeconfig = k8s_cluster.info.root / "users" / f"{user.replace(':', '_')}.kubeconfig"
    assert kubeconfig.exists()
    node = gpu_nodes(["A100-SXM4-40GB"])
    res = client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t", "1g.5gb"))
    core.create_namespaced_pod(namespace, pod("rbac-pod", "t"))
    log = tmp_path / "rbac.log"
    proc = ControllerProcess(
        kubeconfig, "carve-system", log, "carve-rbac", ["--lease-name", f"rbac-{namespace}"[:60]]
    ).start()
    try:
        bound = wait_for("the pod bound", lambda: bound_pods(k8s_api, namespace), timeout=60)
        assert bound[0]["spec"]["nodeName"] == node
        wait_for(
            "the Placed event",
            lambda: any(
                e["reason"] == "Placed" for e in events_for(k8s_api, namespace, "rbac-pod")
            ),
        )
    finally:
        proc.stop()
    text = log.read_text()
    assert "forbidden" not in text.lower(), text[-3000:]


def test_scheduler_postfilter_deallocation_is_replanned_then_left_to_scheduler(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    fake_node: Callable[..., str],
    carve: Any,
) -> None:
    """kube-scheduler's PostFilter clears an unreserved allocation of carve's when the pod fits
    no node: here the GPU node fails on a host port carve does not model, and a second node
    fails only on carve's node selector (so the DRA plugin marks the claim). carve places again
    with growing delays and finally leaves the pod to kube-scheduler instead of looping."""
    gpu = gpu_nodes(["A100-SXM4-40GB"])
    fake_node()
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    blocker = pod("port-holder", "unused", gated=False)
    blocker["spec"].pop("resourceClaims")
    blocker["spec"]["containers"][0]["resources"].pop("claims")
    blocker["spec"]["containers"][0]["ports"] = [{"containerPort": 80, "hostPort": 9999}]
    blocker["spec"]["nodeName"] = gpu
    core.create_namespaced_pod(namespace, blocker)
    res.create_namespaced_resource_claim_template(namespace, profile_template("t", "1g.5gb"))
    body = pod("needs-port", "t")
    body["spec"]["containers"][0]["ports"] = [{"containerPort": 80, "hostPort": 9999}]
    core.create_namespaced_pod(namespace, body)
    carve("carve-a")

    def reasons() -> list[str]:
        return [e["reason"] for e in events_for(k8s_api, namespace, "needs-port")]

    wait_for("a re-placement", lambda: "AllocationCleared" in reasons(), timeout=60)
    wait_for(
        "carve to leave the pod to kube-scheduler",
        lambda: "SchedulerRejectedPlacement" in reasons(),
        timeout=120,
    )
    (claim,) = claims_of(k8s_api, namespace)
    assert "mig.carve.dev/allocation" not in (claim["metadata"].get("finalizers") or [])
    assert_consistent(k8s_api, namespace)
