"""Regression suite: the Kubernetes v1.37 DRA behaviours carve relies on, checked against the
real kube-apiserver, kube-scheduler and kube-controller-manager."""

from __future__ import annotations

import datetime
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from tests.cluster.dra_objects import (
    BINDING_CONDITION,
    BY_NAME,
    Api,
    Partition,
    allocated_devices,
    claim_spec,
    claim_template,
    external_allocation,
    pod,
    pod_condition,
    unique_driver,
)

pytestmark = pytest.mark.cluster

SCHEDULER_FINALIZER = "resource.kubernetes.io/delete-protection"


@dataclass(frozen=True)
class ToyDriver:
    name: str
    device_class: str


@pytest.fixture
def toy_driver(k8s_api: ApiClient) -> Iterator[ToyDriver]:
    """A DeviceClass for a fresh driver name; its slices and class are removed afterwards."""
    api = Api(k8s_api)
    name = unique_driver()
    driver = ToyDriver(name=name, device_class=f"class-{name.split('.')[0]}")
    api.create_class(driver.device_class, driver.name)
    yield driver
    api.resource.delete_collection_resource_slice(field_selector=f"spec.driver={driver.name}")
    api.resource.delete_device_class(driver.device_class)


def _create_template(api: Api, namespace: str, name: str, spec: dict[str, Any]) -> None:
    api.resource.create_namespaced_resource_claim_template(
        namespace, client.V1ResourceClaimTemplate.model_validate(claim_template(name, spec))
    )


def _bound_node(api: Api, namespace: str, name: str) -> str | None:
    node: str | None = api.read_pod(namespace, name).get("spec", {}).get("nodeName")
    return node


def _unschedulable_message(api: Api, namespace: str, name: str) -> str | None:
    cond = pod_condition(api.read_pod(namespace, name), "PodScheduled")
    if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
        return str(cond.get("message", ""))
    return None


def test_template_claim_is_created_allocated_and_pod_bound(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    api = Api(k8s_api)
    node = fake_node()
    api.publish_pool(toy_driver.name, node)
    _create_template(
        api, namespace, "four-g", claim_spec(toy_driver.device_class, toy_driver.name, "4g")
    )
    _create_template(
        api, namespace, "whole", claim_spec(toy_driver.device_class, toy_driver.name, "full")
    )

    api.create_pod(namespace, pod("first", template="four-g"))
    claim_name = wait_for(
        "kube-controller-manager to create the claim", lambda: api.claim_of(namespace, "first")
    )
    assert wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "first")) == node

    claim = api.read_claim(namespace, claim_name)
    owners = claim["metadata"].get("ownerReferences", [])
    assert [(o["kind"], o["name"]) for o in owners] == [("Pod", "first")]
    devices = allocated_devices(claim)
    assert len(devices) == 1
    assert BY_NAME[devices[0]].profile == "4g"
    first_uid = api.read_pod(namespace, "first")["metadata"]["uid"]
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == [first_uid]
    terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    assert json.dumps(terms).count(node) == 1
    # The scheduler allocated this claim, so it protects it with its own finalizer.
    assert SCHEDULER_FINALIZER in claim["metadata"].get("finalizers", [])

    # The whole GPU shares memory-slice counters with the allocated 4g partition.
    api.create_pod(namespace, pod("second", template="whole"))
    message = wait_for(
        "the scheduler to give up on the second pod",
        lambda: _unschedulable_message(api, namespace, "second"),
    )
    assert "cannot allocate all claims" in message
    second_claim = api.read_claim(
        namespace, wait_for("the second claim", lambda: api.claim_of(namespace, "second"))
    )
    assert allocated_devices(second_claim) == []
    assert _bound_node(api, namespace, "second") is None


def test_devices_sharing_memory_slices_are_never_allocated_together(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    api = Api(k8s_api)
    node = fake_node()
    api.publish_pool(toy_driver.name, node)
    _create_template(
        api, namespace, "any", claim_spec(toy_driver.device_class, toy_driver.name, None)
    )
    # At most four partitions fit side by side (the four 2g), so five pods cannot all fit.
    names = [f"p{i}" for i in range(5)]
    for name in names:
        api.create_pod(namespace, pod(name, template="any"))

    def settled() -> dict[str, str | None] | None:
        state: dict[str, str | None] = {}
        for name in names:
            bound = _bound_node(api, namespace, name)
            message = _unschedulable_message(api, namespace, name)
            if bound is None and not (message and "cannot allocate all claims" in message):
                return None
            state[name] = bound
        return state

    state = wait_for("every pod to be bound or rejected for lack of devices", settled, timeout=60)
    bound = [n for n, node_name in state.items() if node_name is not None]
    assert bound, "the scheduler allocated nothing from a free pool"
    assert len(bound) < len(names)
    assert all(state[n] == node for n in bound)

    taken: list[Partition] = []
    for name in names:
        devices = allocated_devices(api.read_claim(namespace, api.claim_of(namespace, name) or ""))
        assert len(devices) == (1 if name in bound else 0)
        taken.extend(BY_NAME[d] for d in devices)
    for a, b in itertools.combinations(taken, 2):
        assert not (a.memory_slices & b.memory_slices), f"{a.name} and {b.name} overlap"


def _allocator_rbac(api: Api, namespace: str, user: str) -> None:
    """Everything an external allocator needs except resourceclaims/binding."""
    api.rbac.create_namespaced_role(
        namespace,
        client.V1Role.model_validate(
            {
                "metadata": {"name": "allocator", "namespace": namespace},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims"],
                        "verbs": ["get", "list", "watch"],
                    },
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims/status"],
                        "verbs": ["get", "update", "patch"],
                    },
                ],
            }
        ),
    )
    api.rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding.model_validate(
            {
                "metadata": {"name": "allocator", "namespace": namespace},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "allocator",
                },
                "subjects": [
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                ],
            }
        ),
    )


@pytest.fixture
def binding_grant(k8s_api: ApiClient) -> Iterator[Any]:
    """Grants resourceclaims/binding to a user cluster-wide; removed after the test."""
    api = Api(k8s_api)
    names: list[str] = []

    def grant(user: str) -> None:
        name = f"carve-test-binding-{user}"[:253]
        api.rbac.create_cluster_role(
            client.V1ClusterRole.model_validate(
                {
                    "metadata": {"name": name},
                    "rules": [
                        {
                            "apiGroups": ["resource.k8s.io"],
                            "resources": ["resourceclaims/binding"],
                            "verbs": ["update", "patch"],
                        }
                    ],
                }
            )
        )
        api.rbac.create_cluster_role_binding(
            client.V1ClusterRoleBinding.model_validate(
                {
                    "metadata": {"name": name},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": name,
                    },
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                    ],
                }
            )
        )
        names.append(name)

    yield grant
    for name in names:
        api.rbac.delete_cluster_role_binding(name)
        api.rbac.delete_cluster_role(name)


def test_externally_allocated_claim_is_honoured(  # noqa: PLR0917 - pytest fixtures
    k8s_cluster: LocalCluster,
    k8s_api: ApiClient,
    namespace: str,
    fake_node: Any,
    toy_driver: ToyDriver,
    binding_grant: Any,
) -> None:
    api = Api(k8s_api)
    decoy, target = fake_node(), fake_node()
    api.publish_pool(toy_driver.name, decoy)
    api.publish_pool(toy_driver.name, target)
    api.resource.create_namespaced_resource_claim(
        namespace,
        client.ResourceV1ResourceClaim.model_validate(
            {
                "metadata": {"name": "ext"},
                "spec": claim_spec(toy_driver.device_class, toy_driver.name, "4g"),
            }
        ),
    )

    user = f"allocator-{namespace}"
    _allocator_rbac(api, namespace, user)
    allocator = client.ResourceV1Api(k8s_cluster.client_for_user(user))
    allocation = {"status": {"allocation": external_allocation(toy_driver.name, target)}}

    def write_allocation() -> Any:
        return allocator.patch_namespaced_resource_claim_status(
            "ext", namespace, allocation, _content_type="application/merge-patch+json"
        )

    # Since 1.36, writing status.allocation also needs the synthetic resourceclaims/binding
    # permission, checked cluster-wide (a namespaced Role cannot grant it). The refusal is a
    # validation error (422, FieldValueForbidden), not a 403.
    with pytest.raises(ApiException) as refused:
        write_allocation()
    assert refused.value.status == 422, refused.value.body
    assert "FieldValueForbidden" in str(refused.value.body)
    assert "resourceclaims/binding" in str(refused.value.body)

    binding_grant(user)

    def try_write() -> bool:
        try:
            write_allocation()
        except ApiException as exc:
            if exc.status == 422 and "resourceclaims/binding" in str(exc.body):
                return False  # the RBAC cache has not seen the new binding yet
            raise
        return True

    wait_for("the allocation write to be authorized", try_write, timeout=15)

    api.create_pod(namespace, pod("consumer", claim="ext"))
    assert (
        wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "consumer")) == target
    )
    uid = api.read_pod(namespace, "consumer")["metadata"]["uid"]

    def reserved() -> dict[str, Any] | None:
        claim = api.read_claim(namespace, "ext")
        entries = claim["status"].get("reservedFor") or []
        return claim if [e["uid"] for e in entries] == [uid] else None

    claim = wait_for("the claim to be reserved for the pod", reserved)
    assert allocated_devices(claim) == ["gpu-0-mig-4g-4"]
    # The scheduler only adds its finalizer to claims it allocated itself: an external
    # allocator owns deallocation and needs a finalizer of its own.
    assert SCHEDULER_FINALIZER not in claim["metadata"].get("finalizers", [])


def test_scheduling_gate_holds_the_pod_until_removed(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    api = Api(k8s_api)
    node = fake_node()
    api.publish_pool(toy_driver.name, node)
    _create_template(
        api, namespace, "four-g", claim_spec(toy_driver.device_class, toy_driver.name, "4g")
    )
    api.create_pod(
        namespace, pod("gated", template="four-g", scheduling_gates=["carve.test/allocate"])
    )

    # kube-controller-manager creates the claim while the pod is still gated, which is
    # the window in which an external allocator can work.
    claim_name = wait_for("the claim of the gated pod", lambda: api.claim_of(namespace, "gated"))
    cond = wait_for(
        "the SchedulingGated condition",
        lambda: pod_condition(api.read_pod(namespace, "gated"), "PodScheduled"),
    )
    assert (cond["status"], cond["reason"]) == ("False", "SchedulingGated")
    time.sleep(2.0)  # give a scheduler that ignored the gate ample time to misbehave
    assert _bound_node(api, namespace, "gated") is None
    assert allocated_devices(api.read_claim(namespace, claim_name)) == []

    api.core.patch_namespaced_pod(
        "gated",
        namespace,
        [{"op": "remove", "path": "/spec/schedulingGates"}],
        _content_type="application/json-patch+json",
    )
    assert wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "gated")) == node
    assert len(allocated_devices(api.read_claim(namespace, claim_name))) == 1


def test_kubectl_1_37_describes_resourceclaims(
    k8s_cluster: LocalCluster, k8s_api: ApiClient, namespace: str, toy_driver: ToyDriver
) -> None:
    api = Api(k8s_api)
    api.resource.create_namespaced_resource_claim(
        namespace,
        client.ResourceV1ResourceClaim.model_validate(
            {
                "metadata": {"name": "described"},
                "spec": claim_spec(toy_driver.device_class, toy_driver.name, "2g"),
            }
        ),
    )
    version = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    assert version["clientVersion"]["minor"] == "37"
    out = k8s_cluster.kubectl("describe", "resourceclaim", "described", "-n", namespace).stdout
    assert "described" in out
    assert toy_driver.device_class in out


def test_external_allocation_without_timestamp_blocks_binding(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    """Pins an upstream 1.37 pitfall carve's allocator must avoid: if status.allocation is
    written without allocationTimestamp, the scheduler's PreBind tries to add one, the
    apiserver rejects that as modifying a set allocation, and the pod never binds. When this
    test fails, upstream changed the behaviour and the allocator's workaround can be revisited.
    """
    api = Api(k8s_api)
    node = fake_node()
    api.publish_pool(toy_driver.name, node)
    api.resource.create_namespaced_resource_claim(
        namespace,
        client.ResourceV1ResourceClaim.model_validate(
            {
                "metadata": {"name": "ext"},
                "spec": claim_spec(toy_driver.device_class, toy_driver.name, "4g"),
            }
        ),
    )
    api.resource.patch_namespaced_resource_claim_status(
        "ext",
        namespace,
        {"status": {"allocation": external_allocation(toy_driver.name, node, timestamp=False)}},
        _content_type="application/merge-patch+json",
    )
    api.create_pod(namespace, pod("consumer", claim="ext"))

    def prebind_error() -> str | None:
        cond = pod_condition(api.read_pod(namespace, "consumer"), "PodScheduled")
        if cond and cond.get("reason") == "SchedulerError":
            return str(cond.get("message"))
        return None

    message = wait_for("the scheduler's PreBind to fail", prebind_error)
    assert "DynamicResources" in message
    assert "field cannot be modified once set" in message
    assert _bound_node(api, namespace, "consumer") is None
    assert not api.read_claim(namespace, "ext")["status"].get("reservedFor")


ALLOCATOR_FINALIZER = "carve.test/allocator"


def _remove_gate(api: Api, namespace: str, name: str) -> None:
    api.core.patch_namespaced_pod(
        name,
        namespace,
        [{"op": "remove", "path": "/spec/schedulingGates"}],
        _content_type="application/json-patch+json",
    )


def test_controller_flow_gate_allocate_ungate_bind_release(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    """carve's controller path end to end at the API level: the claim of a gated pod is
    allocated by someone other than the scheduler, the gate is lifted, the scheduler binds
    to the chosen node, and after the pod is gone the claim is released only by its owner."""
    api = Api(k8s_api)
    decoy, target = fake_node(), fake_node()
    api.publish_pool(toy_driver.name, decoy)
    api.publish_pool(toy_driver.name, target)
    _create_template(
        api, namespace, "four-g", claim_spec(toy_driver.device_class, toy_driver.name, "4g")
    )
    api.create_pod(
        namespace, pod("job", template="four-g", scheduling_gates=["carve.test/placement"])
    )
    claim_name = wait_for("the claim of the gated pod", lambda: api.claim_of(namespace, "job"))

    api.resource.patch_namespaced_resource_claim(
        claim_name,
        namespace,
        {"metadata": {"finalizers": [ALLOCATOR_FINALIZER]}},
        _content_type="application/merge-patch+json",
    )
    api.resource.patch_namespaced_resource_claim_status(
        claim_name,
        namespace,
        {"status": {"allocation": external_allocation(toy_driver.name, target)}},
        _content_type="application/merge-patch+json",
    )
    _remove_gate(api, namespace, "job")
    assert wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "job")) == target
    uid = api.read_pod(namespace, "job")["metadata"]["uid"]

    def reserved() -> dict[str, Any] | None:
        claim = api.read_claim(namespace, claim_name)
        entries = claim["status"].get("reservedFor") or []
        return claim if [e["uid"] for e in entries] == [uid] else None

    claim = wait_for("the claim to be reserved for the pod", reserved)
    assert claim["metadata"]["finalizers"] == [ALLOCATOR_FINALIZER]

    api.core.delete_namespaced_pod("job", namespace, grace_period_seconds=0)

    def released() -> dict[str, Any] | None:
        claim = api.read_claim(namespace, claim_name)
        gone = claim["metadata"].get("deletionTimestamp") and not claim["status"].get("reservedFor")
        return claim if gone else None

    # The garbage collector deletes the pod's claim and the resourceclaim controller drops
    # the reservation, but the allocation stays: only the scheduler's own finalizer makes
    # kube-controller-manager deallocate, so carve must deallocate its claims itself.
    claim = wait_for("the claim to be unreserved and deleting", released)
    assert allocated_devices(claim) == ["gpu-0-mig-4g-4"]
    api.resource.patch_namespaced_resource_claim(
        claim_name,
        namespace,
        {"metadata": {"finalizers": None}},
        _content_type="application/merge-patch+json",
    )

    def deleted() -> bool:
        try:
            api.read_claim(namespace, claim_name)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    wait_for("the claim to disappear once its finalizer is gone", deleted)


def _allocate_externally(api: Api, namespace: str, toy_driver: ToyDriver, node: str) -> None:
    api.resource.create_namespaced_resource_claim(
        namespace,
        client.ResourceV1ResourceClaim.model_validate(
            {
                "metadata": {"name": "ext"},
                "spec": claim_spec(toy_driver.device_class, toy_driver.name, "4g"),
            }
        ),
    )
    api.resource.patch_namespaced_resource_claim_status(
        "ext",
        namespace,
        {"status": {"allocation": external_allocation(toy_driver.name, node)}},
        _content_type="application/merge-patch+json",
    )


def test_scheduler_reallocates_an_external_allocation_that_contradicts_the_pod(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    """Pins the danger an external allocator must design around: when the pod fits no node
    and DRA's own Filter rejected a node because of the claim's nodeSelector, PostFilter
    clears the unreserved allocation, and the scheduler then allocates the claim itself
    somewhere else. carve's controller must only allocate on nodes the pod can use."""
    api = Api(k8s_api)
    chosen, wanted = fake_node(), fake_node()
    api.publish_pool(toy_driver.name, chosen)
    api.publish_pool(toy_driver.name, wanted)
    _allocate_externally(api, namespace, toy_driver, chosen)
    manifest = pod("pinned", claim="ext")
    manifest["spec"]["nodeSelector"] = {"kubernetes.io/hostname": wanted}
    api.create_pod(namespace, manifest)

    assert wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "pinned")) == wanted
    allocation = api.read_claim(namespace, "ext")["status"]["allocation"]
    assert [r["pool"] for r in allocation["devices"]["results"]] == [wanted]


def test_scheduler_keeps_an_external_allocation_when_other_filters_reject(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    """The counterpart: if only non-DRA filters reject (here the node lacks CPU), the pod
    stays Pending and the external allocation is left alone."""
    api = Api(k8s_api)
    small = fake_node(cpu="1")
    api.publish_pool(toy_driver.name, small)
    _allocate_externally(api, namespace, toy_driver, small)
    api.create_pod(namespace, pod("too-big", claim="ext", cpu="4"))

    message = wait_for(
        "the scheduler to reject the pod", lambda: _unschedulable_message(api, namespace, "too-big")
    )
    assert "Insufficient cpu" in message
    claim = api.read_claim(namespace, "ext")
    assert allocated_devices(claim) == ["gpu-0-mig-4g-4"]
    assert not claim["status"].get("reservedFor")


def test_binding_conditions_hold_the_pod_until_the_device_is_ready(
    k8s_api: ApiClient, namespace: str, fake_node: Any, toy_driver: ToyDriver
) -> None:
    """The "carve before bind" direction: devices published with bindingConditions make the
    scheduler allocate, then wait in PreBind until the driver reports the condition True in
    status.devices; only then is the pod bound."""
    api = Api(k8s_api)
    node = fake_node()
    api.publish_pool(toy_driver.name, node, binding_conditions=True)
    _create_template(
        api, namespace, "four-g", claim_spec(toy_driver.device_class, toy_driver.name, "4g")
    )
    api.create_pod(namespace, pod("waits", template="four-g"))
    claim_name = wait_for("the claim", lambda: api.claim_of(namespace, "waits"))

    def allocation() -> dict[str, Any] | None:
        found: dict[str, Any] | None = api.read_claim(namespace, claim_name)["status"].get(
            "allocation"
        )
        return found

    result = wait_for("the scheduler to allocate", allocation)["devices"]["results"][0]
    assert result["bindingConditions"] == [BINDING_CONDITION]
    time.sleep(2.0)
    assert _bound_node(api, namespace, "waits") is None, "bound before the device was ready"

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    api.resource.patch_namespaced_resource_claim_status(
        claim_name,
        namespace,
        {
            "status": {
                "devices": [
                    {
                        "driver": result["driver"],
                        "pool": result["pool"],
                        "device": result["device"],
                        "conditions": [
                            {
                                "type": BINDING_CONDITION,
                                "status": "True",
                                "reason": "Carved",
                                "message": "MIG instance created",
                                "lastTransitionTime": now,
                            }
                        ],
                    }
                ]
            }
        },
        _content_type="application/merge-patch+json",
    )
    # PreBind polls the conditions every few seconds.
    assert (
        wait_for("the pod to be bound", lambda: _bound_node(api, namespace, "waits"), timeout=30)
        == node
    )
