"""carve's Unschedulable hint for Cluster Autoscaler on the real control plane (issue 44.5).

Cluster Autoscaler cannot run here (the Go module proxy serves only CA 1.33.0, whose DRA
simulation cannot read carve's counters), so the contract is checked on what CA reads: the pod
as kube-apiserver serves it, judged by CA's own filter, `isUnschedulable` in
kubernetes/autoscaler cluster-autoscaler/utils/kubernetes/listers.go (`ca_sees_unschedulable`,
tests/support/autoscaler.py: not bound, not deleted, first PodScheduled False/Unschedulable).
A watch records every version of the pod, so the order of carve's writes is what the
apiserver stored, not what the controller meant: the hint goes before the gate does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client import ApiClient

from controller.autoscaling import HINT_PREFIX, SAFE_TO_EVICT, SCHEDULING_GATED
from devcluster.waiting import wait_for
from driver.catalog import gpu_model
from tests.controller.cluster.objects import pod, profile_template, raw
from tests.support.autoscaler import ca_sees_unschedulable, pod_scheduled
from tests.support.real_allocator import allocate, binary, node_slices, run_steps

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GATE = "mig.carve.dev/placement"


class PodVersions:
    """Every version of one pod the apiserver sends on a watch, as (gated, PodScheduled)."""

    def __init__(self, core: client.CoreV1Api, namespace: str, name: str) -> None:
        self.seen: list[tuple[bool, dict[str, Any] | None, bool]] = []
        self._stop = threading.Event()
        self._watch = watch.Watch()
        self._args = (core.list_namespaced_pod, namespace)
        self._selector = f"metadata.name={name}"
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PodVersions:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._watch.stop()
        self._thread.join(10)

    def _run(self) -> None:
        fn, namespace = self._args
        try:
            for ev in self._watch.stream(
                fn, namespace, field_selector=self._selector, timeout_seconds=120
            ):
                obj = client.ApiClient().sanitize_for_serialization(ev["object"])
                gated = any(g.get("name") == GATE for g in obj["spec"].get("schedulingGates") or [])
                self.seen.append((gated, pod_scheduled(obj), ca_sees_unschedulable(obj)))
        except Exception:
            # Once stopped, the watch ends however the connection does (the namespace's teardown
            # can cut it mid-chunk); before that, pytest reports what ended it.
            if not self._stop.is_set():
                raise


def test_a_pod_carve_cannot_place_reads_unschedulable_to_the_autoscaler_until_placed(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    gpu_nodes(["A100-SXM4-40GB"])  # 7 slices of 1g.5gb; the pod asks for 8 on one node
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(
        namespace, profile_template("eight", "1g.5gb", count=8)
    )

    def read() -> dict[str, Any]:
        return raw(core.read_namespaced_pod("big", namespace, _preload_content=False))

    with PodVersions(core, namespace, "big") as versions:
        core.create_namespaced_pod(namespace, pod("big", "eight"))
        carve("carve-a")
        hinted = wait_for("carve's Unschedulable hint", read, until=ca_sees_unschedulable)
        assert hinted["spec"]["schedulingGates"] == [{"name": GATE}], "carve keeps its gate"
        cond = pod_scheduled(hinted)
        assert cond is not None
        assert cond["message"].startswith(HINT_PREFIX), cond
        assert "8 x mig.carve.dev where" in cond["message"], cond
        assert "1g.5gb" in cond["message"], cond

        # A node as a scale-up would add it: carve places the pod there.
        gpu_nodes(["A100-SXM4-40GB", "A100-SXM4-40GB"])
        placed = wait_for(
            "the pod ungated and bound",
            read,
            until=lambda p: not p["spec"].get("schedulingGates") and p["spec"].get("nodeName"),
            timeout=60,
        )
        assert not ca_sees_unschedulable(placed)
        # Placed with a slice and not opted in as movable: a scale-down must not drain it.
        assert placed["metadata"]["annotations"][SAFE_TO_EVICT] == "false"
        wait_for(
            "the watch to see the bound pod",
            lambda: versions.seen,
            until=lambda seen: any(c is not None and c.get("status") == "True" for _, c, _ in seen),
            timeout=30,
        )

    seen = versions.seen
    assert any(gated and ca for gated, _, ca in seen), seen
    ungated = [i for i, (gated, _, _) in enumerate(seen) if not gated]
    assert ungated, seen
    first_ungated = ungated[0]
    # Never the gate gone while carve's hint still stood: the reset landed first...
    for gated, cond, _ in seen:
        if not gated and cond is not None:
            assert not (cond.get("message") or "").startswith(HINT_PREFIX), seen
    # ...as the apiserver's own SchedulingGated, on the last version that still had the gate.
    gated_before, cond_before, _ = seen[first_ungated - 1]
    assert gated_before and cond_before is not None, seen
    assert cond_before["reason"] == SCHEDULING_GATED, seen


def test_a_users_safe_to_evict_is_kept_and_movable_pods_are_not_marked(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(namespace, profile_template("one", "1g.5gb"))
    users = pod("users", "one")
    users["metadata"]["annotations"] = {SAFE_TO_EVICT: "true"}
    movable = pod("movable", "one")
    movable["metadata"]["annotations"] = {"mig.carve.dev/movable": "true"}
    plain = pod("plain", "one")
    for body in (users, movable, plain):
        core.create_namespaced_pod(namespace, body)
    carve("carve-a")

    def annotations(name: str) -> dict[str, str]:
        p = raw(core.read_namespaced_pod(name, namespace, _preload_content=False))
        if p["spec"].get("schedulingGates"):
            return {"gated": "yes"}
        return dict(p["metadata"].get("annotations") or {})

    gone = lambda a: "gated" not in a  # noqa: E731
    assert wait_for("users ungated", lambda: annotations("users"), until=gone)[SAFE_TO_EVICT] == (
        "true"
    )
    assert SAFE_TO_EVICT not in wait_for(
        "movable ungated", lambda: annotations("movable"), until=gone
    )
    assert wait_for("plain ungated", lambda: annotations("plain"), until=gone)[SAFE_TO_EVICT] == (
        "false"
    )


def _as_template(slices: list[dict[str, Any]], node: str, suffix: str) -> list[dict[str, Any]]:
    """CA's copy of a node's slices for a node group's template: `SanitizedNodeResourceSlices`
    (cluster-autoscaler/simulator/dynamicresources/utils/sanitize.go) points them at the new
    node and appends `-<suffix>` to every slice and pool name."""
    out = []
    for s in slices:
        copy = json.loads(json.dumps(s))
        copy["metadata"] = {"name": f"{s['metadata']['name']}-{suffix}"}
        copy["spec"]["nodeName"] = node
        copy["spec"]["pool"]["name"] = f"{s['spec']['pool']['name']}-{suffix}"
        out.append(copy)
    return out


def test_kube_schedulers_allocator_takes_the_pending_claim_on_a_template_copy(
    k8s_api: ApiClient, namespace: str, gpu_nodes: Callable[[list[str]], str], carve: Any
) -> None:
    """What CA's DRA simulation runs (kube-scheduler's structured allocator, dra-allocate, the
    v0.37.2 library) on what CA would feed it: the claim carve's hint is about, as the
    apiserver holds it, and a renamed copy of a node's slices. A copy of the node that cannot
    hold the pod refuses it, as carve did; a copy of a node of a group with two GPUs takes it."""
    one = gpu_nodes(["A100-SXM4-40GB"])
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(
        namespace, profile_template("eight", "1g.5gb", count=8)
    )
    core.create_namespaced_pod(namespace, pod("big", "eight"))
    carve("carve-a")
    wait_for(
        "carve's Unschedulable hint",
        lambda: raw(core.read_namespaced_pod("big", namespace, _preload_content=False)),
        until=ca_sees_unschedulable,
    )
    (pending,) = raw(res.list_namespaced_resource_claim(namespace, _preload_content=False))["items"]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": pending["metadata"]["name"], "namespace": namespace},
        "spec": pending["spec"],
    }
    published = [
        s
        for s in raw(res.list_resource_slice(_preload_content=False))["items"]
        if s["spec"].get("nodeName") == one
    ]
    assert published, f"node {one} publishes no slices"
    exe = binary(build=False)
    [same] = run_steps(
        _as_template(published, "template-1", "ca1"), [allocate(claim)], node="template-1", exe=exe
    )
    assert same.status == "unschedulable", same
    group = node_slices([gpu_model("A100-SXM4-40GB")] * 2, node="group-node")
    [bigger] = run_steps(
        _as_template(group, "template-2", "ca2"), [allocate(claim)], node="template-2", exe=exe
    )
    assert bigger.allocated, bigger
    assert len(bigger.devices) == 8
