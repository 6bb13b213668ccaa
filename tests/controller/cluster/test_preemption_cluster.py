"""MIG-aware preemption with the real carve-controller on the real control plane (v1.37).

One fake node with two A100-40GB GPUs is filled by ReplicaSets (kube-controller-manager runs
the replicaset controller, so evicted pods come back as replacements). Priorities come from
real PriorityClasses (the Priority admission plugin writes ``spec.priority``). Evictions go
through the real Eviction API, where kube-apiserver itself enforces PodDisruptionBudgets, whose
status (``disruptionsAllowed``) kube-controller-manager's disruption controller computes.

No kubelet runs: the test plays it by marking bound pods Running and by finishing the deletion
of pods that the Eviction API marked terminating.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from controller.objects import Kind
from controller.planner import EnginePlanner
from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from tests.controller.cluster.objects import (
    claims_of,
    ensure_cluster_object,
    events_for,
    load_manifests,
    pods_of,
    profile_template,
    raw,
)
from tests.support.controller_cluster import ControllerProcess, assert_consistent

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOW, HIGH = "carve-test-low", "carve-test-high"
GATE = "mig.carve.dev/placement"


@pytest.fixture(scope="module")
def priority_classes(k8s_api: ApiClient) -> None:
    api = client.SchedulingV1Api(k8s_api)
    for name, value in ((LOW, 100), (HIGH, 1000)):
        try:
            api.create_priority_class(
                {
                    "metadata": {"name": name},
                    "value": value,
                    "preemptionPolicy": "PreemptLowerPriority",
                }
            )
        except ApiException as exc:
            if exc.status != 409:
                raise


def _pod_spec(template: str, priority_class: str) -> Obj:
    return {
        "priorityClassName": priority_class,
        "schedulingGates": [{"name": GATE}],
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": template}],
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/none",
                "resources": {"requests": {"cpu": "10m"}, "claims": [{"name": "mig"}]},
            }
        ],
    }


def _replica_set(name: str, template: str, replicas: int, priority_class: str) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": _pod_spec(template, priority_class),
            },
        },
    }


class Kubelet:
    """Plays the kubelet for pods bound to the fake node: they run, and a pod marked
    terminating (an eviction) is deleted once its grace period (0 s) is over."""

    def __init__(self, api: ApiClient, ns: str) -> None:
        self.core = client.CoreV1Api(api)
        self.api = api
        self.ns = ns
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                for p in pods_of(self.api, self.ns):
                    name = p["metadata"]["name"]
                    if p["metadata"].get("deletionTimestamp"):
                        self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
                    elif p["spec"].get("nodeName") and p["status"].get("phase") == "Pending":
                        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                        # Ready, as a kubelet reports it: the disruption controller counts
                        # only ready pods as healthy when it computes a budget's allowance.
                        ready = {"type": "Ready", "status": "True", "lastTransitionTime": now}
                        status = {"phase": "Running", "startTime": now, "conditions": [ready]}
                        self.core.patch_namespaced_pod_status(name, self.ns, {"status": status})
            except ApiException:
                pass
            self.stop.wait(0.2)


@pytest.fixture
def kubelet(k8s_api: ApiClient, namespace: str) -> Iterator[Kubelet]:
    k = Kubelet(k8s_api, namespace)
    k.thread.start()
    yield k
    k.stop.set()
    k.thread.join(5)


def _shipped_rbac_kubeconfig(cluster: LocalCluster, api: ApiClient) -> Path:
    """A kubeconfig of carve-controller's ServiceAccount with only the shipped RBAC
    (deploy/manifests/20-rbac-controller.yaml): evictions and PDB reads must be in it."""
    from kubernetes import utils
    from kubernetes.utils import FailToCreateError

    try:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": "carve-system"}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(api, obj)
    for obj in load_manifests("20-rbac-controller.yaml"):
        try:
            utils.create_from_dict(api, obj)
        except FailToCreateError as exc:
            if any(e.status != 409 for e in exc.api_exceptions):
                raise
    user = "system:serviceaccount:carve-system:carve-controller"
    cluster.client_for_user(user, ("system:serviceaccounts", "system:serviceaccounts:carve-system"))
    kubeconfig = cluster.info.root / "users" / f"{user.replace(':', '_')}.kubeconfig"
    assert kubeconfig.exists()
    return kubeconfig


def _owner(p: Obj) -> str:
    refs = p["metadata"].get("ownerReferences") or []
    return str(refs[0]["name"]) if refs else ""


def _running(api: ApiClient, ns: str, owner: str | None = None) -> list[Obj]:
    return [
        p
        for p in pods_of(api, ns)
        if p["status"].get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
        and (owner is None or _owner(p) == owner)
    ]


def _slices_of(api: ApiClient, ns: str) -> dict[str, tuple[str, int, int]]:
    """pod name -> (GPU uuid, profile id, first memory slice) of its allocated claim."""
    planner = EnginePlanner()
    for s in raw(client.ResourceV1Api(api).list_resource_slice(_preload_content=False))["items"]:
        planner.observe(Kind.SLICE, s)
    planner.flush()
    by_claim = {c["metadata"]["name"]: c for c in claims_of(api, ns)}
    out = {}
    for p in pods_of(api, ns):
        for st in p["status"].get("resourceClaimStatuses") or []:
            c = by_claim.get(st.get("resourceClaimName"))
            alloc = ((c or {}).get("status") or {}).get("allocation")
            if alloc:
                (r,) = alloc["devices"]["results"]
                hit = planner.model.device(r["pool"], r["device"])
                assert hit is not None
                out[p["metadata"]["name"]] = (hit[0].uuid, hit[1].profile_id, hit[1].start)
    return out


def _fill(api: ApiClient, ns: str) -> dict[str, tuple[str, int, int]]:
    """GPU 1: `big` (4g.20gb, low) at slices 0-3 and `peer` (3 x 1g.5gb at the preemptor's
    own priority) at 4-6; GPU 2: `small` (7 x 1g.5gb, low). One at a time, so carve's best fit
    packs them in this order."""
    res, apps = client.ResourceV1Api(api), client.AppsV1Api(api)
    res.create_namespaced_resource_claim_template(ns, profile_template("t4g", "4g.20gb"))
    res.create_namespaced_resource_claim_template(ns, profile_template("t1g", "1g.5gb"))
    running = 0
    for name, template, n, prio in (
        ("big", "t4g", 1, LOW),
        ("peer", "t1g", 3, HIGH),
        ("small", "t1g", 7, LOW),
    ):
        apps.create_namespaced_replica_set(ns, _replica_set(name, template, n, prio))
        running += n
        wait_for(f"{name} running", lambda r=running: len(_running(api, ns)) == r, timeout=90)
    where = _slices_of(api, ns)
    gpus = {
        owner: {where[p["metadata"]["name"]][0] for p in _running(api, ns, owner)}
        for owner in ("big", "peer", "small")
    }
    assert gpus["big"] == gpus["peer"] and len(gpus["big"]) == 1
    assert len(gpus["small"]) == 1 and gpus["small"] != gpus["big"]
    return where


def _preemptor(api: ApiClient, ns: str, name: str) -> float:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": _pod_spec("t4g", HIGH),
    }
    client.CoreV1Api(api).create_namespaced_pod(ns, body)
    return time.monotonic()


def _reasons(api: ApiClient, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in events_for(api, ns, name)]


@pytest.mark.usefixtures("kubelet", "priority_classes")
def test_the_cheapest_victim_is_evicted_and_its_placement_goes_to_the_preemptor(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
) -> None:
    gpu_nodes(["A100-SXM4-40GB", "A100-SXM4-40GB"])
    carve("carve-a")
    before = _fill(k8s_api, namespace)
    (big,) = [p["metadata"]["name"] for p in _running(k8s_api, namespace, "big")]
    others = {p["metadata"]["name"] for p in _running(k8s_api, namespace)} - {big}
    started = _preemptor(k8s_api, namespace, "urgent")
    # A pod that could use any single freed slice, arriving while the victim terminates.
    thief = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "thief"},
        "spec": _pod_spec("t1g", LOW),
    }
    client.CoreV1Api(k8s_api).create_namespaced_pod(namespace, thief)

    def urgent_bound() -> Obj | None:
        p = raw(
            client.CoreV1Api(k8s_api).read_namespaced_pod(
                "urgent", namespace, _preload_content=False
            )
        )
        return p if p["spec"].get("nodeName") else None

    wait_for("the preemptor bound", urgent_bound, timeout=90)
    bound_s = time.monotonic() - started
    wait_for(
        "the preemptor running",
        lambda: any(p["metadata"]["name"] == "urgent" for p in _running(k8s_api, namespace)),
        timeout=30,
    )
    running_s = time.monotonic() - started
    after = _slices_of(k8s_api, namespace)
    # Exactly the cheapest set: the one 4g.20gb pod (one victim beats four 1g.5gb of the same
    # priority); the preemptor has its placement; nobody else was evicted.
    assert after["urgent"] == before[big]
    alive = {p["metadata"]["name"] for p in pods_of(k8s_api, namespace)}
    assert big not in alive
    assert others <= alive
    assert "thief" not in after
    # Events and conditions are written beside the decision thread: the bind may come first.
    evs = wait_for(
        "the Preempting event on urgent",
        lambda: events_for(k8s_api, namespace, "urgent"),
        until=lambda evs: any(e["reason"] == "Preempting" for e in evs),
        timeout=30,
    )
    preempting = [e for e in evs if e["reason"] == "Preempting"]
    assert preempting and big in preempting[0]["note"], [e["note"] for e in evs]
    wait_for(
        "carve's Placed event on urgent",
        lambda: _reasons(k8s_api, namespace, "urgent"),
        until=lambda reasons: "Placed" in reasons,
        timeout=30,
    )

    def placed_condition() -> Obj:
        conditions = (
            raw(
                client.CoreV1Api(k8s_api).read_namespaced_pod(
                    "urgent", namespace, _preload_content=False
                )
            )["status"].get("conditions")
            or []
        )
        return {c["type"]: c for c in conditions}.get("mig.carve.dev/Placed") or {}

    # A waiting (False) condition may be the one listed until the placement's True lands.
    cond = wait_for(
        "urgent's Placed condition True",
        placed_condition,
        until=lambda c: c.get("status") == "True",
        timeout=30,
    )
    assert cond["status"] == "True"
    # The victim was told by whom and for what, and its ReplicaSet re-queued it: a
    # replacement waits gated, with carve's reason (the GPUs are full again).
    # (The victim pod is gone; its events stay, addressed to its name.)
    wait_for(
        f"the Preempted event on {big} naming urgent",
        lambda: events_for(k8s_api, namespace, big),
        until=lambda evs: any(e["reason"] == "Preempted" and "urgent" in e["note"] for e in evs),
        timeout=30,
    )

    def replacement() -> Obj | None:
        for p in pods_of(k8s_api, namespace):
            name = p["metadata"]["name"]
            if _owner(p) == "big" and name != big and events_for(k8s_api, namespace, name):
                return p
        return None

    new = wait_for("the victim's replacement waiting", replacement, timeout=60)
    assert new["spec"].get("schedulingGates")
    assert new["metadata"]["name"] not in _slices_of(k8s_api, namespace)
    assert_consistent(k8s_api, namespace)
    print(f"preemptor created -> bound {bound_s:.2f}s, -> Running {running_s:.2f}s (1 victim)")


@pytest.mark.usefixtures("kubelet", "priority_classes")
def test_a_pdb_refusal_waits_with_a_reason_then_another_set_is_evicted(
    k8s_cluster: LocalCluster,
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    tmp_path: Path,
) -> None:
    """With only the shipped RBAC, so that evictions and PDB reads are proven granted."""
    gpu_nodes(["A100-SXM4-40GB", "A100-SXM4-40GB"])
    log = tmp_path / "rbac.log"
    proc = ControllerProcess(
        _shipped_rbac_kubeconfig(k8s_cluster, k8s_api),
        "carve-system",
        log,
        "carve-rbac",
        ["--lease-name", f"preempt-{namespace}"[:60]],
    ).start()
    try:
        _pdb_case(k8s_api, namespace)
    finally:
        proc.stop()
    text = log.read_text()
    assert "forbidden" not in text.lower(), text[-3000:]


def _pdb_case(k8s_api: ApiClient, namespace: str) -> None:
    before = _fill(k8s_api, namespace)
    (big,) = [p["metadata"]["name"] for p in _running(k8s_api, namespace, "big")]
    policy = client.PolicyV1Api(k8s_api)
    # `big` is one pod: minAvailable 1 leaves it no disruption; `small` allows none at first.
    budgets = {"big": {"minAvailable": 1}, "small": {"maxUnavailable": 0}}
    for app, budget in budgets.items():
        policy.create_namespaced_pod_disruption_budget(
            namespace,
            {
                "metadata": {"name": app},
                "spec": {**budget, "selector": {"matchLabels": {"app": app}}},
            },
        )
    for app in budgets:
        wait_for(
            f"the disruption controller to observe budget {app}",
            lambda app=app: (
                policy.read_namespaced_pod_disruption_budget(
                    app, namespace
                ).status.observed_generation
            ),
            timeout=30,
        )
    alive_before = {p["metadata"]["name"] for p in pods_of(k8s_api, namespace)}
    started = _preemptor(k8s_api, namespace, "urgent")
    blocked = wait_for(
        "the preemptor told why it waits",
        lambda: [
            e
            for e in events_for(k8s_api, namespace, "urgent")
            if e["reason"] == "PreemptionBlocked"
        ],
        timeout=60,
    )
    note = blocked[0]["note"]
    assert "their PodDisruptionBudgets forbid it" in note, note
    assert f"{namespace}/big (allows 0 more)" in note, note  # the cheapest set is `big`
    assert {p["metadata"]["name"] for p in pods_of(k8s_api, namespace)} == alive_before | {"urgent"}
    # The small pods' budget now allows four; the big pod's stays, so carve evicts the four
    # 1g.5gb pods at slices 0-3 of the other GPU (never the peers of equal priority next to
    # `big`), within the budget the disruption controller computes.
    policy.patch_namespaced_pod_disruption_budget(
        "small", namespace, {"spec": {"maxUnavailable": 4}}
    )

    def urgent_bound() -> bool:
        p = raw(
            client.CoreV1Api(k8s_api).read_namespaced_pod(
                "urgent", namespace, _preload_content=False
            )
        )
        return bool(p["spec"].get("nodeName"))

    wait_for("the preemptor bound", urgent_bound, timeout=90)
    bound_s = time.monotonic() - started
    after = _slices_of(k8s_api, namespace)
    gone = alive_before - {p["metadata"]["name"] for p in pods_of(k8s_api, namespace)}
    assert len(gone) == 4
    assert {before[g][2] for g in gone} == {0, 1, 2, 3}
    assert all(g.startswith("small-") for g in gone)
    small_gpu = before[next(iter(gone))][0]
    assert after["urgent"] == (small_gpu, before[big][1], 0)
    assert_consistent(k8s_api, namespace)
    print(f"with a PDB refusal first: preemptor created -> bound {bound_s:.2f}s (4 victims)")
