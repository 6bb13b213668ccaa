"""Builders for the DRA objects the regression suite writes (plain dicts, as on the wire).

A toy GPU with eight memory slices stands in for a MIG-capable GPU: one counter set with a
``memory-slice-<i>`` counter per slice, published in its own ResourceSlice as Kubernetes
>= 1.35 requires, and devices for a few (profile, placement) pairs plus the whole GPU.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client import ApiClient

MEMORY_SLICES = 8
COUNTER_SET = "gpu-0-counter-set"


@dataclass(frozen=True)
class Partition:
    """A device of the toy GPU: profile name, first memory slice, number of slices."""

    name: str
    profile: str
    start: int
    size: int

    @property
    def memory_slices(self) -> frozenset[int]:
        return frozenset(range(self.start, self.start + self.size))


# Overlapping on purpose: gpu-0 covers everything, the 4g and 2g placements overlap.
PARTITIONS: tuple[Partition, ...] = (
    Partition("gpu-0-mig-4g-0", "4g", 0, 4),
    Partition("gpu-0-mig-4g-4", "4g", 4, 4),
    Partition("gpu-0-mig-2g-0", "2g", 0, 2),
    Partition("gpu-0-mig-2g-2", "2g", 2, 2),
    Partition("gpu-0-mig-2g-4", "2g", 4, 2),
    Partition("gpu-0-mig-2g-6", "2g", 6, 2),
    Partition("gpu-0", "full", 0, MEMORY_SLICES),
)
BY_NAME: Mapping[str, Partition] = {p.name: p for p in PARTITIONS}


def unique_driver() -> str:
    """Each test publishes under its own driver name, so cluster-scoped slices and classes
    of concurrent tests never match each other's claims."""
    return f"t{uuid.uuid4().hex[:8]}.gpu.carve.test"


def device_class(name: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def counter_slice(driver: str, node: str, generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-counters"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 2},
            "sharedCounters": [
                {
                    "name": COUNTER_SET,
                    "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(MEMORY_SLICES)},
                }
            ],
        },
    }


BINDING_CONDITION = "carved"
BINDING_FAILURE_CONDITION = "carve-failed"


def device_slice(
    driver: str,
    node: str,
    partitions: Iterable[Partition] = PARTITIONS,
    generation: int = 1,
    *,
    binding_conditions: bool = False,
) -> dict[str, Any]:
    """With ``binding_conditions`` every device asks the scheduler to wait in PreBind until
    the driver reports it ready, the "carve before bind" flow."""
    binding: dict[str, Any] = {}
    if binding_conditions:
        binding = {
            "bindsToNode": True,
            "bindingConditions": [BINDING_CONDITION],
            "bindingFailureConditions": [BINDING_FAILURE_CONDITION],
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-devices"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 2},
            "devices": [
                {
                    "name": p.name,
                    "attributes": {
                        "profile": {"string": p.profile},
                        "placementStart": {"int": p.start},
                    },
                    "consumesCounters": [
                        {
                            "counterSet": COUNTER_SET,
                            "counters": {
                                f"memory-slice-{i}": {"value": "1"} for i in sorted(p.memory_slices)
                            },
                        }
                    ],
                    **binding,
                }
                for p in partitions
            ],
        },
    }


def claim_spec(device_class_name: str, driver: str, profile: str | None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class_name, "count": 1}
    if profile is not None:
        exactly["selectors"] = [
            {"cel": {"expression": f'device.attributes["{driver}"].profile == "{profile}"'}}
        ]
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def claim_template(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": spec},
    }


def pod(
    name: str,
    *,
    template: str | None = None,
    claim: str | None = None,
    scheduling_gates: Iterable[str] = (),
    cpu: str | None = None,
) -> dict[str, Any]:
    claims = []
    if template is not None:
        claims.append({"name": "gpu", "resourceClaimTemplateName": template})
    if claim is not None:
        claims.append({"name": "gpu", "resourceClaimName": claim})
    container: dict[str, Any] = {"name": "main", "image": "registry.invalid/carve-test:none"}
    resources: dict[str, Any] = {}
    if claims:
        resources["claims"] = [{"name": "gpu"}]
    if cpu is not None:
        resources["requests"] = {"cpu": cpu}
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {"containers": [container], "resourceClaims": claims}
    if scheduling_gates:
        spec["schedulingGates"] = [{"name": g} for g in scheduling_gates]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


class Api:
    """The typed clients a test needs, created once per test from the admin ApiClient."""

    def __init__(self, api: ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)

    def publish_pool(self, driver: str, node: str, *, binding_conditions: bool = False) -> None:
        self.resource.create_resource_slice(
            client.V1ResourceSlice.model_validate(counter_slice(driver, node))
        )
        self.resource.create_resource_slice(
            client.V1ResourceSlice.model_validate(
                device_slice(driver, node, binding_conditions=binding_conditions)
            )
        )

    def create_class(self, name: str, driver: str) -> None:
        self.resource.create_device_class(
            client.V1DeviceClass.model_validate(device_class(name, driver))
        )

    def create_pod(self, namespace: str, manifest: dict[str, Any]) -> None:
        self.core.create_namespaced_pod(namespace, client.V1Pod.model_validate(manifest))

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return as_dict(self.core.read_namespaced_pod(name, namespace))

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return as_dict(self.resource.read_namespaced_resource_claim(name, namespace))

    def claim_of(self, namespace: str, pod_name: str) -> str | None:
        """The generated claim name kube-controller-manager recorded in the pod status."""
        statuses = (
            self.read_pod(namespace, pod_name).get("status", {}).get("resourceClaimStatuses") or []
        )
        names = [s.get("resourceClaimName") for s in statuses if s.get("name") == "gpu"]
        return names[0] if names and names[0] else None


def as_dict(model: Any) -> dict[str, Any]:
    """Wire-format (camelCase) dict of a client model, so tests read fields as in YAML."""
    result: dict[str, Any] = client.ApiClient().sanitize_for_serialization(model)  # type: ignore[no-untyped-call]
    return result


def pod_condition(pod_obj: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in pod_obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def allocated_devices(claim: Mapping[str, Any]) -> list[str]:
    allocation = claim.get("status", {}).get("allocation") or {}
    return [r["device"] for r in allocation.get("devices", {}).get("results", [])]


def external_allocation(
    driver: str, node: str, device: str = "gpu-0-mig-4g-4", *, timestamp: bool = True
) -> dict[str, Any]:
    """status.allocation as an allocator other than kube-scheduler writes it: one result
    from the node's pool and a nodeSelector pinning the claim to that node.

    ``allocationTimestamp`` is required in practice on 1.37: with binding conditions
    enabled, the scheduler's PreBind fills it in when missing, and the apiserver refuses
    that as a modification of an already-set allocation."""
    allocation: dict[str, Any] = {
        "devices": {
            "results": [{"request": "gpu", "driver": driver, "pool": node, "device": device}]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    if timestamp:
        now = datetime.datetime.now(datetime.UTC)
        allocation["allocationTimestamp"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return allocation
