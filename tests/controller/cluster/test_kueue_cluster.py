"""carve with a queue in front of it: another scheduling gate holds a pod, carve waits.

The real carve-controller, kube-scheduler and kube-controller-manager, and in the last test the
real Kueue v0.17.0 manager (hack/kueue/build.sh) with its real webhooks, quota in Kueue's DRA
integration (`deviceClassMappings`). Nodes are simulated as in test_controller_cluster.py: no
kubelet runs, so the test plays the kubelet's part (Running, then Succeeded) through pods/status.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from controller.work import GATED_ELSEWHERE
from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT
from tests.controller.cluster import kueue as kq
from tests.controller.cluster.objects import (
    GATE_LABEL,
    REPO,
    claims_of,
    events_for,
    pod,
    raw,
    template,
)
from tests.support.controller_cluster import assert_consistent, bound_pods
from tests.support.guide import read_page

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CARVE_GATE = DEFAULT_CONTRACT.scheduling_gate
PROFILE = "1g.5gb"
PROFILE_CLASS = "mig-1g-5gb.mig.carve.dev"  # a class per profile, as the chart renders them
QUOTA = "carve.dev/mig-1g.5gb"  # Kueue's logical resource for that class


def _profile_class() -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": PROFILE_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": 'device.driver == "mig.carve.dev" && '
                        'device.attributes["mig.carve.dev"].type == "mig" && '
                        f'device.attributes["mig.carve.dev"].profile == "{PROFILE}"'
                    }
                }
            ]
        },
    }


@pytest.fixture
def profile_class(k8s_api: ApiClient) -> str:
    res = client.ResourceV1Api(k8s_api)
    try:
        res.create_device_class(_profile_class())
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    return PROFILE_CLASS


def _pod(api: ApiClient, ns: str, name: str) -> Obj:
    return raw(client.CoreV1Api(api).read_namespaced_pod(name, ns, _preload_content=False))


def _gates(p: Obj) -> list[str]:
    return [g["name"] for g in p["spec"].get("schedulingGates") or []]


def _claim_of(api: ApiClient, ns: str, pod_name: str) -> Obj | None:
    for c in claims_of(api, ns):
        owners = c["metadata"].get("ownerReferences") or []
        if any(o["kind"] == "Pod" and o["name"] == pod_name for o in owners):
            return c
    return None


def _untouched_by_carve(claim: Obj | None) -> bool:
    """The pod's claim exists (kube-controller-manager creates it for a gated pod too) and
    carve has not allocated it (its finalizer is there from creation: carve's admission
    policy adds it, whoever places the pod)."""
    assert claim is not None, "kube-controller-manager has not created the pod's claim"
    return not (claim.get("status") or {}).get("allocation")


def _reasons(api: ApiClient, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in events_for(api, ns, name)]


def _refused_by_kueue(api: ApiClient, ns: str, pod: str) -> bool:
    """Kueue tried to admit the pod's workload and found no quota: QuotaReserved False with
    reason Pending (kueue v0.17, pkg/scheduler: UnsetQuotaReservationWithCondition)."""
    for w in kq.workloads(api, ns):
        if pod in {o["name"] for o in w["metadata"].get("ownerReferences") or []}:
            conditions = (w.get("status") or {}).get("conditions") or []
            return any(
                (c["type"], c["status"], c["reason"]) == ("QuotaReserved", "False", "Pending")
                for c in conditions
            )
    return False


def _play_kubelet(api: ApiClient, ns: str, name: str, phase: str) -> None:
    client.CoreV1Api(api).patch_namespaced_pod_status(name, ns, {"status": {"phase": phase}})


def test_a_pod_held_by_another_gate_is_not_carved_until_that_gate_goes(
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
    profile_class: str,
) -> None:
    node = gpu_nodes(["A100-SXM4-40GB"])
    core, res = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, template("t", cls=profile_class))
    body = pod("held", "t")
    body["spec"]["schedulingGates"].append({"name": "example.com/hold"})
    core.create_namespaced_pod(namespace, body)
    # The pod and its claim are complete before carve starts, so nothing about them changes
    # after carve's first look, and carve looks again only at a change: no retry timer runs
    # for a pod held by another gate (controller/reconciler.py, `_wake_later`). That no
    # passes over time carve it is proven with a fake clock in
    # tests/controller/test_reconciler_gates.py; here, what carve does on the real objects.
    wait_for("the pod's claim", lambda: _claim_of(k8s_api, namespace, "held"), timeout=30)
    carve("carve-a")

    def placed() -> list[tuple[str, str]]:
        conditions = (_pod(k8s_api, namespace, "held").get("status") or {}).get("conditions")
        kind = DEFAULT_CONTRACT.placed_condition
        return [(c["status"], c["reason"]) for c in conditions or [] if c["type"] == kind]

    assert wait_for("carve's condition on the pod", placed, timeout=30) == [
        ("False", GATED_ELSEWHERE)
    ]
    wait_for(
        "carve to say why it waits",
        lambda: GATED_ELSEWHERE in _reasons(k8s_api, namespace, "held"),
        timeout=30,
    )
    assert _untouched_by_carve(_claim_of(k8s_api, namespace, "held"))
    assert _gates(_pod(k8s_api, namespace, "held")) == [CARVE_GATE, "example.com/hold"]
    # Said once (one Event object; a repeat would raise its count).
    told = [e for e in events_for(k8s_api, namespace, "held") if e["reason"] == GATED_ELSEWHERE]
    assert len(told) == 1 and (told[0].get("series") or {}).get("count", 1) == 1, told
    assert "example.com/hold" in told[0]["note"]

    current = _pod(k8s_api, namespace, "held")
    current["spec"]["schedulingGates"] = [{"name": CARVE_GATE}]
    core.replace_namespaced_pod("held", namespace, current)
    bound = wait_for(
        "the released pod placed and bound",
        lambda: [p for p in bound_pods(k8s_api, namespace) if p["metadata"]["name"] == "held"],
        timeout=60,
    )
    assert bound[0]["spec"]["nodeName"] == node
    claim = _claim_of(k8s_api, namespace, "held")
    assert claim is not None and claim["status"]["allocation"]
    assert_consistent(k8s_api, namespace)


# -- the real Kueue -------------------------------------------------------------------------

GUIDE = read_page(REPO / "docs" / "guide" / "kueue.md")


def _guide_docs(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(GUIDE.files[name]) if d]


@pytest.fixture
def kueue(
    k8s_cluster: LocalCluster, k8s_api: ApiClient, namespace: str, tmp_path: Path
) -> Iterator[kq.KueueProcess]:
    """Kueue with the guide's configuration, against the suite's cluster, managing `namespace`
    only."""
    dist = kq.kueue_dist()
    core = client.CoreV1Api(k8s_api)
    core.patch_namespace(namespace, {"metadata": {"labels": {kq.MANAGED_LABEL: "on"}}})
    (user_config,) = _guide_docs("kueue-config.yaml")
    manager = kq.start(k8s_api, dist, k8s_cluster.info.kubeconfig, tmp_path, user_config)
    try:
        yield manager
    finally:
        manager.stop()
        kq.uninstall_webhooks(k8s_api, dist)
        kq.release_namespace(k8s_api, namespace)


def _both_gates_added(api: ApiClient, ns: str, body: Obj) -> bool:
    """Dry run: do carve's admission policy and Kueue's pod webhook (called by the apiserver)
    both gate this pod yet? Each reaches the apiserver through an informer, not at once."""
    probe = copy.deepcopy(body)
    probe["metadata"]["name"] = "probe"
    created = raw(
        client.CoreV1Api(api).create_namespaced_pod(
            ns, probe, dry_run="All", _preload_content=False
        )
    )
    return {CARVE_GATE, kq.ADMISSION_GATE} <= set(_gates(created))


def test_kueue_quota_admits_two_pods_carve_carves_them_the_third_waits_in_kueue(
    *,
    k8s_api: ApiClient,
    namespace: str,
    gpu_nodes: Callable[[list[str]], str],
    carve: Any,
    profile_class: str,
    gate_policies: None,
    kueue: kq.KueueProcess,
) -> None:
    """docs/guide/kueue.md's files as they are: quota for two 1g.5gb slices, three pods."""
    # One A100 40GB holds seven 1g.5gb slices: the GPU has room for all three pods, so only
    # Kueue's quota (two) can be what holds the third.
    gpu_nodes(["A100-SXM4-40GB"])
    core, res = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    core.patch_namespace(namespace, {"metadata": {"labels": {GATE_LABEL: "on"}}})
    for obj in _guide_docs("kueue-queues.yaml"):
        kq.create(k8s_api, namespace, obj)
    claim_template, job = _guide_docs("kueue-job.yaml")
    assert (
        claim_template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]
        == profile_class
    )
    res.create_namespaced_resource_claim_template(namespace, claim_template)
    carve("carve-a")
    wait_for("both admission gates active", lambda: _both_gates_added(k8s_api, namespace, job))
    names = ["job-0", "job-1", "job-2"]
    for name in names:
        body = copy.deepcopy(job)
        body["metadata"]["name"] = name
        created = raw(core.create_namespaced_pod(namespace, body, _preload_content=False))
        # Admission, not the test, gated the pod: carve's policy and Kueue's webhook (v0.17
        # also adds its topology gate, which it removes itself).
        assert {CARVE_GATE, kq.ADMISSION_GATE} <= set(_gates(created)), created["spec"]
        time.sleep(1.1)  # distinct creation seconds: Kueue's FIFO order is then job-0, -1, -2

    first = wait_for(
        "two pods admitted by Kueue, carved and bound",
        lambda: (b := bound_pods(k8s_api, namespace)) and len(b) >= 2 and b,
        timeout=90,
    )
    (waiting,) = set(names) - {p["metadata"]["name"] for p in first}
    # Both have looked at the third and said no: Kueue found no quota left for it, and carve
    # told why it does not plan it. Nothing then changes for it until a pod ends.
    wait_for(
        f"Kueue to find no quota for {waiting}",
        lambda: _refused_by_kueue(k8s_api, namespace, waiting),
        timeout=60,
    )
    wait_for(
        f"carve to say why it does not plan {waiting}",
        lambda: GATED_ELSEWHERE in _reasons(k8s_api, namespace, waiting),
        timeout=30,
    )
    bound = {p["metadata"]["name"] for p in bound_pods(k8s_api, namespace)}
    assert len(first) == 2 and len(bound) == 2, bound
    wl = kq.workloads(k8s_api, namespace)
    assert sum(kq.is_admitted(w) for w in wl) == 2, [w.get("status") for w in wl]
    held = _pod(k8s_api, namespace, waiting)
    assert kq.ADMISSION_GATE in _gates(held) and CARVE_GATE in _gates(held)
    # Waits in Kueue, not in carve: its claim was not allocated nor even touched by carve,
    # and carve told once why it does not plan it.
    assert _untouched_by_carve(_claim_of(k8s_api, namespace, waiting))
    assert _reasons(k8s_api, namespace, waiting).count(GATED_ELSEWHERE) == 1
    for name in bound:
        claim = _claim_of(k8s_api, namespace, name)
        assert claim is not None and claim["status"]["allocation"], name
        wait_for(
            f"carve's Placed event on {name}",
            lambda name=name: "Placed" in _reasons(k8s_api, namespace, name),
            timeout=30,
        )
        _play_kubelet(k8s_api, namespace, name, "Running")
    assert_consistent(k8s_api, namespace)

    done = sorted(bound)[0]
    _play_kubelet(k8s_api, namespace, done, "Succeeded")
    wait_for(
        f"{waiting} admitted by Kueue once {done} finished, then carved and bound",
        lambda: any(p["metadata"]["name"] == waiting for p in bound_pods(k8s_api, namespace)),
        timeout=90,
    )
    claim = _claim_of(k8s_api, namespace, waiting)
    assert claim is not None and claim["status"]["allocation"]
    # Events are written beside the decision thread: the bind may come first.
    wait_for(
        f"carve's Placed event on {waiting}",
        lambda: "Placed" in _reasons(k8s_api, namespace, waiting),
        timeout=30,
    )
    # Quota held by the two running pods only; the finished one's workload is Finished.
    wl = kq.workloads(k8s_api, namespace)
    active = [w for w in wl if kq.is_admitted(w) and not kq.has_condition(w, "Finished")]
    assert len(active) == 2, [w.get("status") for w in wl]
    assert_consistent(k8s_api, namespace)
