"""KubeClaimWriter and LeaderElector on the real kube-apiserver, with the real kube-scheduler.

The writer's allocation (finalizer, status.allocation through the binding subresource, gate
removal) must be honoured by kube-scheduler: the pod binds to the allocated node and the claim
is reserved for it. Conflicts come from real resourceVersion races.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from controller.leader import LeaderElector, LeaseConfig
from controller.objects import ClaimAllocation
from controller.status import KubeClaimWriter
from devcluster.cluster import LocalCluster, run_kubectl
from devcluster.waiting import wait_for
from driver.allocation import AllocatedDevice
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER
from process.kube.jsonclient import KubeJson
from tests.controller.cluster.objects import (
    DRIVER,
    delete_node_slices,
    ensure_cluster_object,
    load_manifests,
    pod,
    pods_of,
    profile_template,
    publish_node_gpus,
    raw,
)

ALLOCATION_FINALIZER = DEFAULT_CONTRACT.allocation_finalizer

pytestmark = pytest.mark.cluster


def _writer(api: ApiClient) -> KubeClaimWriter:
    return KubeClaimWriter(KubeJson(api))


def test_written_allocation_is_honoured_by_kube_scheduler(
    k8s_api: ApiClient, namespace: str, fake_node: Callable[..., str]
) -> None:
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(k8s_api, obj)
    nodes = [fake_node(), fake_node()]
    for n in nodes:
        publish_node_gpus(k8s_api, n, ["A100-SXM4-40GB"])
    try:
        res, core = client.ResourceV1Api(k8s_api), client.CoreV1Api(k8s_api)
        res.create_namespaced_resource_claim_template(namespace, profile_template("t", "1g.5gb"))
        core.create_namespaced_pod(namespace, pod("p", "t"))
        p = wait_for(
            "KCM to create the pod's claim",
            lambda: next(
                (
                    x
                    for x in pods_of(k8s_api, namespace)
                    if (x.get("status") or {}).get("resourceClaimStatuses")
                ),
                None,
            ),
        )
        claim_name = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        claim = raw(
            res.read_namespaced_resource_claim(claim_name, namespace, _preload_content=False)
        )
        target = nodes[1]  # not the first node, so a scheduler that ignored us would differ
        alloc = ClaimAllocation(
            namespace,
            claim_name,
            claim["metadata"]["uid"],
            target,
            (AllocatedDevice("mig", DRIVER, target, "gpu-0-mig-1g5gb-19-3", profile="1g.5gb"),),
        )
        w = _writer(k8s_api)
        stale = copy.deepcopy(claim)
        claim = w.add_finalizer(claim)
        # Writing from the stale copy: 409 from the real apiserver, re-read, then success.
        claim = w.write_allocation(stale, alloc, {})
        assert claim["metadata"]["finalizers"] == [ALLOCATION_FINALIZER]
        w.remove_gate(p)

        def bound() -> str | None:
            cur = raw(core.read_namespaced_pod("p", namespace, _preload_content=False))
            return cur["spec"].get("nodeName")

        assert wait_for("kube-scheduler to bind the pod", bound) == target
        reserved = wait_for(
            "the claim to be reserved for the pod",
            lambda: raw(
                res.read_namespaced_resource_claim(claim_name, namespace, _preload_content=False)
            )["status"].get("reservedFor"),
        )
        assert reserved[0]["name"] == "p"
    finally:
        for n in nodes:
            delete_node_slices(k8s_api, n)


def test_lease_election_on_the_apiserver(k8s_api: ApiClient, namespace: str) -> None:
    coord = client.CoordinationV1Api(k8s_api)

    def elector(who: str) -> LeaderElector:
        return LeaderElector(
            KubeJson(k8s_api),
            LeaseConfig(
                name="carve-controller",
                namespace=namespace,
                identity=who,
                lease_duration_s=3,
                renew_deadline_s=2,
                retry_period_s=0.5,
            ),
        )

    a, b = elector("a"), elector("b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.try_acquire_or_renew()  # renew
    assert not b.try_acquire_or_renew()
    # a stops renewing without releasing: b must wait out the lease duration on its own clock.
    a.stop(release=False)
    wait_for("b to take the expired lease", b.try_acquire_or_renew, timeout=10)
    lease = raw(coord.read_namespaced_lease("carve-controller", namespace, _preload_content=False))
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    # Released on shutdown: a fresh candidate gets it at once.
    b.stop(release=True)
    c = elector("c")
    assert c.try_acquire_or_renew()


def test_repeated_events_fold_into_one_series(k8s_api: ApiClient, namespace: str) -> None:
    from controller.events import KubeRecorder
    from controller.objects import Kind

    core = client.CoreV1Api(k8s_api)
    p = raw(core.create_namespaced_pod(namespace, pod("ev", "t"), _preload_content=False))
    rec = KubeRecorder(KubeJson(k8s_api))
    for _ in range(3):
        rec.event(p, Kind.POD, "Warning", "NoCapacity", "no H100 has a free 3g.40gb placement")
    rec.event(p, Kind.POD, "Normal", "Placed", "placed on node-a")
    evs = raw(
        client.EventsV1Api(k8s_api).list_namespaced_event(
            namespace, field_selector="regarding.name=ev", _preload_content=False
        )
    )["items"]
    by_reason = {
        e["reason"]: e for e in evs if e.get("reportingController") == "mig.carve.dev/controller"
    }
    assert set(by_reason) == {"NoCapacity", "Placed"}
    assert by_reason["NoCapacity"]["series"]["count"] == 3
    assert by_reason["NoCapacity"]["regarding"]["uid"] == p["metadata"]["uid"]
    assert by_reason["NoCapacity"]["reportingController"] == "mig.carve.dev/controller"


# A claim as users write it: opaque config for carve and for another driver, with parameters of
# any shape. kubectl sends compact JSON; the apiserver keeps opaque parameters as the raw bytes
# it received and compares those bytes when it checks that the spec did not change.
_CLAIM_WITH_CONFIG = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: with-config
spec:
  devices:
    requests:
    - name: m
      exactly:
        deviceClassName: mig.carve.dev
    config:
    - requests: ["m"]
      opaque:
        driver: mig.carve.dev
        parameters:
          apiVersion: mig.carve.dev/v1alpha1
          kind: MigDeviceConfig
          sharing: {strategy: TimeSlicing, timeSlicing: {interval: Long}}
    - opaque:
        driver: other.example.com
        parameters: {list: [1, 2.5, "three", null, {deep: [true]}], "ünïcode": "✓", n: 1e3}
"""


def test_writes_never_alter_the_spec_of_a_claim_with_opaque_config(
    k8s_cluster: LocalCluster, k8s_api: ApiClient, namespace: str
) -> None:
    """Regression: every write used to PUT the whole claim back; Python re-serialises the
    opaque parameters with other bytes, and the apiserver refused it as a spec change
    (`spec: Invalid value: null: field is immutable`), so such claims were never placed."""
    run_kubectl(
        Path(k8s_cluster.info.kubeconfig),
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=_CLAIM_WITH_CONFIG,
    )
    res = client.ResourceV1Api(k8s_api)

    def read() -> dict[str, Any]:
        return raw(
            res.read_namespaced_resource_claim("with-config", namespace, _preload_content=False)
        )

    before = read()
    w = _writer(k8s_api)
    alloc = ClaimAllocation(
        namespace,
        "with-config",
        before["metadata"]["uid"],
        "node-x",
        (AllocatedDevice("m", DRIVER, "node-x", "gpu-0-mig-1g5gb-19-3", profile="1g.5gb"),),
    )
    claim = w.add_finalizer(before)
    claim = w.write_allocation(claim, alloc, {})
    assert (
        claim["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]
        == (before["spec"]["devices"]["config"][0]["opaque"]["parameters"])
    )
    claim = w.clear_allocation(claim)
    claim = w.remove_finalizer(claim)
    after = read()
    assert after["spec"] == before["spec"]
    assert not after["metadata"].get("finalizers")
    assert not (after.get("status") or {}).get("allocation")

    # The hand-over to kube-scheduler: one JSON patch that tests the resourceVersion, so a
    # copy made stale by another write is read again (422) before it lands.
    stale = w.add_finalizer(after)
    res.patch_namespaced_resource_claim(
        "with-config", namespace, {"metadata": {"labels": {"seen": "yes"}}}
    )
    w.hand_to_scheduler(stale)
    handed = read()
    assert handed["spec"] == before["spec"]
    assert not handed["metadata"].get("finalizers")
    assert handed["metadata"]["labels"] == {"seen": "yes"}
    annotation = DEFAULT_CONTRACT.allocator_annotation
    assert handed["metadata"]["annotations"][annotation] == HANDED_TO_SCHEDULER
