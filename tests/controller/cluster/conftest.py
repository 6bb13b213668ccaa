"""Controller suites on the real control plane (kube-apiserver, kube-scheduler, KCM v1.37).

The devcluster fixtures are imported rather than declared through `pytest_plugins`, which
pytest accepts only in the top-level conftest.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from devcluster.pytest_plugin import (  # noqa: F401  (fixtures)
    fake_node,
    k8s_api,
    k8s_cluster,
    namespace,
    node_heartbeater,
)
from tests.controller.cluster.objects import GATE_LABEL, ensure_cluster_object, load_manifests


@pytest.fixture(scope="package")
def gate_policies(k8s_api: ApiClient) -> Iterator[None]:  # noqa: F811
    """The shipped gate policies, bound only to namespaces labelled GATE_LABEL=on.

    For the suite's whole cluster: the apiserver picks up a re-created policy of the same name
    only slowly.
    """
    adm = client.AdmissionregistrationV1Api(k8s_api)
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(k8s_api, obj)
    names = []
    for obj in load_manifests("30-admission-gate.yaml"):
        if obj["kind"] == "MutatingAdmissionPolicyBinding":
            obj["spec"]["matchResources"] = {
                "namespaceSelector": {"matchLabels": {GATE_LABEL: "on"}}
            }
            names.append(obj["metadata"]["name"])
        ensure_cluster_object(k8s_api, obj)
    yield
    for name in names:
        adm.delete_mutating_admission_policy_binding(name)
        adm.delete_mutating_admission_policy(name)
