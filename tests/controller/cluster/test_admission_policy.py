"""The gate MutatingAdmissionPolicy of deploy/manifests on the real kube-apiserver.

The policies are applied exactly as shipped, except that their bindings are narrowed to
namespaces labelled for this suite, so pods of other suites sharing the cluster are untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from tests.controller.cluster.objects import (
    GATE_LABEL,
    create_pod_when_policy_ready,
    pod,
    raw,
    template,
)

pytestmark = pytest.mark.cluster

GATE = "mig.carve.dev/placement"


@pytest.fixture
def gated_ns(namespace: str, k8s_api: ApiClient, gate_policies: None) -> str:
    client.CoreV1Api(k8s_api).patch_namespace(
        namespace, {"metadata": {"labels": {GATE_LABEL: "on"}}}
    )
    return namespace


def _gates(p: dict[str, Any]) -> list[str]:
    return [g["name"] for g in p["spec"].get("schedulingGates") or []]


def test_pods_with_carve_templates_get_the_gate(k8s_api: ApiClient, gated_ns: str) -> None:
    res = client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(gated_ns, template("carve-1g"))
    created = create_pod_when_policy_ready(k8s_api, gated_ns, pod("user", "carve-1g", gated=False))
    assert _gates(created) == [GATE]


def test_first_available_with_a_carve_subrequest_is_gated(
    k8s_api: ApiClient, gated_ns: str
) -> None:
    res = client.ResourceV1Api(k8s_api)
    t = template("flex")
    t["spec"]["spec"]["devices"]["requests"] = [
        {
            "name": "mig",
            "firstAvailable": [
                {"name": "other", "deviceClassName": "gpu.example.com"},
                {"name": "carve", "deviceClassName": "3g.mig.carve.dev"},
            ],
        }
    ]
    res.create_namespaced_resource_claim_template(gated_ns, t)
    created = create_pod_when_policy_ready(k8s_api, gated_ns, pod("flex-user", "flex", gated=False))
    assert _gates(created) == [GATE]


def test_pods_with_a_carve_resource_claim_get_the_gate(k8s_api: ApiClient, gated_ns: str) -> None:
    res = client.ResourceV1Api(k8s_api)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "shared"},
        "spec": template("x")["spec"]["spec"],
    }
    res.create_namespaced_resource_claim(gated_ns, claim)
    body = pod("shared-user", "unused", gated=False)
    body["spec"]["resourceClaims"] = [{"name": "mig", "resourceClaimName": "shared"}]
    created = create_pod_when_policy_ready(k8s_api, gated_ns, body)
    assert _gates(created) == [GATE]


def test_other_pods_are_untouched(k8s_api: ApiClient, gated_ns: str) -> None:
    res = client.ResourceV1Api(k8s_api)
    core = client.CoreV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(gated_ns, template("carve-1g"))
    res.create_namespaced_resource_claim_template(
        gated_ns, template("nvidia", cls="gpu.nvidia.com")
    )
    # Make sure the policies are active in this apiserver before judging "not gated".
    create_pod_when_policy_ready(k8s_api, gated_ns, pod("carve-user", "carve-1g", gated=False))
    other = raw(
        core.create_namespaced_pod(
            gated_ns, pod("nvidia-user", "nvidia", gated=False), _preload_content=False
        )
    )
    plain = pod("plain", "unused", gated=False)
    plain["spec"].pop("resourceClaims")
    plain["spec"]["containers"][0]["resources"].pop("claims")
    plain_created = raw(core.create_namespaced_pod(gated_ns, plain, _preload_content=False))
    assert _gates(other) == []
    assert _gates(plain_created) == []


def test_existing_gates_are_kept_and_not_duplicated(k8s_api: ApiClient, gated_ns: str) -> None:
    res = client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim_template(gated_ns, template("a"))
    res.create_namespaced_resource_claim_template(gated_ns, template("b"))
    body = pod("two", "a", gated=False)
    body["spec"]["resourceClaims"].append({"name": "second", "resourceClaimTemplateName": "b"})
    body["spec"]["schedulingGates"] = [{"name": "example.com/other"}, {"name": GATE}]
    created = create_pod_when_policy_ready(k8s_api, gated_ns, body)
    assert sorted(_gates(created)) == sorted(["example.com/other", GATE])


def _limits_pod(name: str, resources: dict[str, str], *, init: bool = False) -> dict[str, Any]:
    body = pod(name, "unused", gated=False)
    body["spec"].pop("resourceClaims")
    container = body["spec"]["containers"][0]
    container["resources"] = {"limits": dict(resources)}
    if init:
        body["spec"]["initContainers"] = [dict(container, name="setup")]
        container["resources"] = {}
    return body


@pytest.mark.parametrize(
    ("resources", "init", "gated"),
    [
        ({"nvidia.com/mig-1g.10gb": "1"}, False, True),
        ({"nvidia.com/mig-3g.40gb": "1"}, True, True),
        ({"deviceclass.resource.kubernetes.io/mig-3g-40gb.mig.carve.dev": "1"}, False, True),
        ({"deviceclass.resource.kubernetes.io/gpu.carve.dev": "1"}, False, True),
        ({"nvidia.com/gpu": "1"}, False, True),  # the whole-GPU class's (chart default)
        ({"nvidia.com/mig-9g.99gb": "1"}, False, False),  # no class of carve's names it
        ({"deviceclass.resource.kubernetes.io/gpu.nvidia.com": "1"}, False, False),
    ],
    ids=[
        "profile",
        "init-container",
        "implicit-profile",
        "implicit-gpu",
        "gpu",
        "unknown",
        "foreign",
    ],
)
def test_pods_asking_carve_extended_resources_get_the_gate(
    k8s_api: ApiClient,
    gated_ns: str,
    resources: dict[str, str],
    init: bool,
    gated: bool,
) -> None:
    # Active policies first (a pod that must be gated), then the case under test.
    create_pod_when_policy_ready(
        k8s_api, gated_ns, _limits_pod("probe", {"nvidia.com/mig-1g.10gb": "1"})
    )
    body = _limits_pod("asks", resources, init=init)
    created = raw(
        client.CoreV1Api(k8s_api).create_namespaced_pod(gated_ns, body, _preload_content=False)
    )
    assert _gates(created) == ([GATE] if gated else [])
