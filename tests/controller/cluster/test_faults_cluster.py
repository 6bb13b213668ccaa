"""carve-controller under apiserver faults (issue 30), on the real control plane.

A real HTTP proxy (`tests.support.apiproxy`) sits between the controller process and
kube-apiserver and misbehaves on cue: it forwards an allocation PATCH and drops its answer, or
holds a write in flight. kube-scheduler and kube-controller-manager talk to the apiserver
directly. Fake nodes publish ResourceSlices as the plugin does; no kubelet runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from nodesim.invariants import NodeHardware, allocated_devices, overlaps
from tests.controller.cluster.objects import (
    DRIVER,
    claims_of,
    delete_node_slices,
    ensure_cluster_object,
    load_manifests,
    publish_node_gpus,
)
from tests.support.apiproxy import ApiProxy
from tests.support.controller_cluster import ControllerProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

H100 = "H100-SXM5-80GB"


@pytest.fixture
def proxy(k8s_cluster: LocalCluster) -> Iterator[ApiProxy]:
    with ApiProxy(Path(k8s_cluster.info.kubeconfig)) as p:
        yield p


@pytest.fixture
def classes(k8s_api: ApiClient) -> None:
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(k8s_api, obj)


@pytest.fixture
def h100_node(k8s_api: ApiClient, fake_node: Callable[..., str]) -> Iterator[str]:
    name = fake_node()
    publish_node_gpus(k8s_api, name, [H100])
    yield name
    delete_node_slices(k8s_api, name)


def whole_mig_claim(name: str) -> Obj:
    """A claim for the one 7g.80gb placement of an H100: two such claims cannot share it."""
    selector = f'device.attributes["{DRIVER}"].profile == "7g.80gb"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
    }


def gated_pod(name: str, claim: str, priority_class: str | None = None) -> Obj:
    spec: Obj = {
        "schedulingGates": [{"name": f"{DRIVER}/placement"}],
        "resourceClaims": [{"name": "mig", "resourceClaimName": claim}],
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/none",
                "resources": {"claims": [{"name": "mig"}]},
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


HIGH = "carve-faults-high"


@pytest.fixture
def high_priority(k8s_api: ApiClient) -> None:
    """A PriorityClass, so that a like pod is served before the one whose write failed."""
    with contextlib.suppress(client.ApiException):
        client.SchedulingV1Api(k8s_api).create_priority_class(
            {"metadata": {"name": HIGH}, "value": 1000}
        )


def _allocation_of(name: str) -> Callable[[str, str, bytes], bool]:
    def match(method: str, path: str, body: bytes) -> bool:
        return (
            method == "PATCH"
            and f"/resourceclaims/{name}/status" in path
            and b'"allocation": {' in body
        )

    return match


def _claim_watch(method: str, path: str, body: bytes) -> bool:
    return method == "GET" and "resourceclaims" in path and "watch=" in path


def _placed_condition(core: client.CoreV1Api, ns: str, pod: str) -> Obj | None:
    got = core.read_namespaced_pod(pod, ns, _preload_content=False)
    for cond in (json.loads(got.data).get("status") or {}).get("conditions") or []:
        if cond.get("type") == f"{DRIVER}/Placed":
            return dict(cond)
    return None


@pytest.mark.usefixtures("classes", "high_priority")
def test_an_allocation_whose_answer_is_dropped_is_never_given_to_a_like_pod(
    k8s_api: ApiClient, namespace: str, h100_node: str, proxy: ApiProxy, tmp_path: Path
) -> None:
    """p1's allocation PATCH is applied but its answer is dropped; a like pod of higher
    priority (so it is served first once anything looks free) waits meanwhile. The claim watch
    lags, so only the controller's own handling of the lost answer can keep the device held."""
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    for name in ("first", "second"):
        res.create_namespaced_resource_claim(namespace, whole_mig_claim(name))
    proxy.hold(_claim_watch)  # released only after the verdict
    in_flight = proxy.hold(_allocation_of("first"))
    proxy.drop_response(_allocation_of("first"))
    controller = ControllerProcess(
        proxy.kubeconfig(tmp_path / "via-proxy.kubeconfig"),
        namespace,
        tmp_path / "controller.log",
        "carve-faults",
        ["--leader-elect=false", "--retry-interval=1s", "--preemption=false"],
    ).start()
    try:
        core.create_namespaced_pod(namespace, gated_pod("p1", "first"))
        wait_for("p1's allocation to be in flight", lambda: in_flight.requests, timeout=60)
        core.create_namespaced_pod(namespace, gated_pod("p2", "second", HIGH))
        wait_for("p2 to wait", lambda: _placed_condition(core, namespace, "p2"), timeout=60)
        in_flight.release()
        wait_for("the allocation's answer to be dropped", lambda: proxy.faults.dropped, 60)
        placed = wait_for(
            "one of the pods to be placed",
            lambda: [
                p
                for p in ("p1", "p2")
                # Placed: carve removed its gate (a pod placed at once gets no condition).
                if not core.read_namespaced_pod(p, namespace).spec.scheduling_gates
            ],
            timeout=60,
        )
        proxy.release_all()
        held = allocated_devices(claims_of(k8s_api, namespace), DRIVER)
        hardware = {h100_node: NodeHardware(h100_node, {0: _model(H100)}, instances=())}
        assert not overlaps(held, hardware), [f"{d.claim}: {d.device}" for d in held]
        assert [d.claim for d in held] == [f"{namespace}/first"]
        assert placed == ["p1"]
    finally:
        proxy.release_all()
        controller.stop()


def _model(key: str) -> Any:
    from driver.catalog import gpu_model

    return gpu_model(key)


def _holder(k8s_api: ApiClient, namespace: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(k8s_api).read_namespaced_lease(
            "carve-controller", namespace
        )
    except client.ApiException:
        return None
    return lease.spec.holder_identity


def _renewed_by_leader_after(
    k8s_api: ApiClient, namespace: str, leader: ControllerProcess, stopped_at: dt.datetime
) -> bool:
    """Whether carve-leader renewed its lease two lease durations after `stopped_at`; fails
    the test if the lease was handed over (or the leader exited) before."""
    lease = client.CoordinationV1Api(k8s_api).read_namespaced_lease("carve-controller", namespace)
    assert lease.spec.holder_identity == "carve-leader", "handed over mid-write"
    assert leader.proc is not None and leader.proc.poll() is None
    renewed = lease.spec.renew_time
    return renewed is not None and renewed > stopped_at + dt.timedelta(seconds=8)


@pytest.fixture
def long_request_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Longer than a test holds a write (an unknown variable to a controller without it)."""
    monkeypatch.setenv("CARVE_REQUEST_TIMEOUT", "60s")


@pytest.mark.usefixtures("classes", "h100_node", "long_request_timeout")
def test_a_write_in_flight_across_a_hand_over_keeps_the_lease_until_it_lands(
    k8s_cluster: LocalCluster, k8s_api: ApiClient, namespace: str, proxy: ApiProxy, tmp_path: Path
) -> None:
    """The leader (through the proxy) is stopped while its allocation PATCH is held in flight.
    The lease must stay its own until that write has landed (client-go's ReleaseOnCancel);
    then it is handed back at once and the follower takes over."""
    res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim(namespace, whole_mig_claim("first"))
    leader = ControllerProcess(
        proxy.kubeconfig(tmp_path / "via-proxy.kubeconfig"),
        namespace,
        tmp_path / "leader.log",
        "carve-leader",
        ["--preemption=false"],
    ).start()
    follower: ControllerProcess | None = None
    try:
        wait_for("the leader", lambda: _holder(k8s_api, namespace) == "carve-leader", 60)
        follower = ControllerProcess(
            Path(k8s_cluster.info.kubeconfig),
            namespace,
            tmp_path / "follower.log",
            "carve-follower",
            ["--preemption=false"],
        ).start()
        in_flight = proxy.hold(_allocation_of("first"))
        core.create_namespaced_pod(namespace, gated_pod("p1", "first"))
        wait_for("the allocation to be in flight", lambda: in_flight.requests, timeout=60)
        assert leader.proc is not None
        stopped_at = dt.datetime.now(dt.UTC)
        leader.proc.terminate()  # SIGTERM: a graceful stop
        # The leader keeps renewing its lease while its write is held: wait for a renewal two
        # lease durations (8 s) after SIGTERM, time enough for a released or expired lease to
        # be taken; it must be the leader's own at every look until then.
        wait_for(
            "a renewal by the stopping leader two lease durations after SIGTERM",
            lambda: _renewed_by_leader_after(k8s_api, namespace, leader, stopped_at),
            timeout=60,
        )
        in_flight.release()
        assert leader.proc.wait(30) == 0
        wait_for("the follower", lambda: _holder(k8s_api, namespace) == "carve-follower", 30)
        allocated = allocated_devices(claims_of(k8s_api, namespace), DRIVER)
        assert [d.claim for d in allocated] == [f"{namespace}/first"]
        wait_for(
            "p1 ungated by the new leader",
            lambda: not core.read_namespaced_pod("p1", namespace).spec.scheduling_gates,
            timeout=60,
        )
    finally:
        proxy.release_all()
        leader.stop()
        if follower is not None:
            follower.stop()
