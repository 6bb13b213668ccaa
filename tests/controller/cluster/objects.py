"""Builders and small API helpers shared by the controller's cluster suites."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = REPO / "deploy" / "manifests"
DRIVER = "mig.carve.dev"
GATE_LABEL = "carve.test/admission-gate"
"""Namespaces with this label (value "on") are gated by the `gate_policies` fixture."""


def load_manifests(name: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def raw(resp: Any) -> Obj:
    out: Obj = json.loads(resp.data)
    return out


def ensure_cluster_object(api: ApiClient, obj: Obj) -> None:
    """Create a cluster-scoped object (DeviceClass, admission policy) unless it exists."""
    kind = obj["kind"]
    try:
        if kind == "DeviceClass":
            client.ResourceV1Api(api).create_device_class(obj)
        elif kind == "MutatingAdmissionPolicy":
            client.AdmissionregistrationV1Api(api).create_mutating_admission_policy(obj)
        elif kind == "MutatingAdmissionPolicyBinding":
            client.AdmissionregistrationV1Api(api).create_mutating_admission_policy_binding(obj)
        else:
            raise ValueError(f"unsupported kind {kind}")
    except ApiException as exc:
        if exc.status != 409:
            raise


def gpu(key: str, minor: int, node: str) -> PublishedGpu:
    tag = f"{abs(hash((node, minor))) % 16**12:012x}"
    return PublishedGpu(
        minor=minor,
        uuid=f"GPU-{minor:08x}-0000-4000-8000-{tag}",
        model=gpu_model(key),
        pci_bus_id=f"0000:{minor + 7:02x}:00.0",
        driver_version="580.105.08",
    )


def publish_node_gpus(api: ApiClient, node: str, models: Iterable[str]) -> list[Obj]:
    """Publish `node`'s GPUs exactly as the kubelet plugin does (driver.resourceslice)."""
    gpus = [gpu(key, i, node) for i, key in enumerate(models)]
    slices = build_resource_slices(driver=DRIVER, node_name=node, pool_generation=1, gpus=gpus)
    res = client.ResourceV1Api(api)
    for s in slices:
        res.create_resource_slice(s)
    return slices


def delete_node_slices(api: ApiClient, node: str) -> None:
    client.ResourceV1Api(api).delete_collection_resource_slice(
        field_selector=f"spec.nodeName={node}"
    )


def template(name: str, selector: str | None = None, count: int = 1, cls: str = DRIVER) -> Obj:
    exact: Obj = {"deviceClassName": cls, "count": count}
    if selector:
        exact["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": exact}]}}},
    }


def profile_template(name: str, profile: str, count: int = 1) -> Obj:
    return template(name, f'device.attributes["{DRIVER}"].profile == "{profile}"', count)


def pod(name: str, template_name: str, *, gated: bool = True, cpu: str = "100m") -> Obj:
    spec: Obj = {
        "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": template_name}],
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/none",
                "resources": {"requests": {"cpu": cpu}, "claims": [{"name": "mig"}]},
            }
        ],
        "terminationGracePeriodSeconds": 0,
    }
    if gated:
        spec["schedulingGates"] = [{"name": "mig.carve.dev/placement"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def claims_of(api: ApiClient, ns: str) -> list[Obj]:
    items: list[Obj] = raw(
        client.ResourceV1Api(api).list_namespaced_resource_claim(ns, _preload_content=False)
    )["items"]
    return items


def pods_of(api: ApiClient, ns: str) -> list[Obj]:
    items: list[Obj] = raw(client.CoreV1Api(api).list_namespaced_pod(ns, _preload_content=False))[
        "items"
    ]
    return items


def allocated_devices(claims: Iterable[Obj]) -> list[tuple[str, str]]:
    out = []
    for c in claims:
        alloc = (c.get("status") or {}).get("allocation") or {}
        for r in alloc.get("devices", {}).get("results", []):
            out.append((r["pool"], r["device"]))
    return out


def events_for(api: ApiClient, ns: str, name: str) -> list[Obj]:
    items: list[Obj] = raw(
        client.EventsV1Api(api).list_namespaced_event(
            ns, field_selector=f"regarding.name={name}", _preload_content=False
        )
    )["items"]
    return items


def create_pod_when_policy_ready(api: ApiClient, ns: str, body: Obj) -> Obj:
    """Policies and their parameters reach the admission plugin through informers; the first
    pod may arrive before they have. Create probe pods until the gate shows, then the real one."""
    core = client.CoreV1Api(api)

    def probe() -> bool:
        p = copy.deepcopy(body)
        p["metadata"]["name"] = "probe-" + body["metadata"]["name"]
        created = raw(core.create_namespaced_pod(ns, p, _preload_content=False))
        core.delete_namespaced_pod(p["metadata"]["name"], ns, grace_period_seconds=0)
        return bool(created["spec"].get("schedulingGates"))

    wait_for("the gate policy to be active", probe, timeout=40)
    return raw(core.create_namespaced_pod(ns, body, _preload_content=False))
