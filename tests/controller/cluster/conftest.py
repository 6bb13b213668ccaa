"""Controller suites on the real control plane (kube-apiserver, kube-scheduler, KCM v1.37):
one cluster for the package, the shipped gate policies, carve-controller processes (`carve`)
and fake GPU nodes publishing the plugin's slices (`gpu_nodes`).

The devcluster fixtures are imported rather than declared through `pytest_plugins`, which
pytest accepts only in the top-level conftest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from devcluster.cluster import LocalCluster
from devcluster.pytest_plugin import (  # noqa: F401  (fixtures)
    fake_node,
    k8s_api,
    k8s_cluster,
    namespace,
    node_heartbeater,
)
from tests.controller.cluster.objects import (
    GATE_LABEL,
    delete_node_slices,
    ensure_cluster_object,
    load_manifests,
    publish_node_gpus,
)
from tests.support.controller_cluster import ControllerProcess


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
    for obj in [
        *load_manifests("30-admission-gate.yaml"),
        *load_manifests("32-claim-finalizer.yaml"),
    ]:
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


@pytest.fixture
def carve(
    k8s_cluster: LocalCluster,  # noqa: F811
    k8s_api: ApiClient,  # noqa: F811
    namespace: str,  # noqa: F811
    tmp_path: Path,
) -> Iterator[Callable[..., ControllerProcess]]:
    """start(identity, *extra args) -> a running carve-controller, stopped after the test."""
    for obj in load_manifests("10-deviceclasses.yaml"):
        ensure_cluster_object(k8s_api, obj)
    started: list[ControllerProcess] = []

    def start(identity: str = "carve-a", *extra: str) -> ControllerProcess:
        p = ControllerProcess(
            k8s_cluster.info.kubeconfig,
            namespace,
            tmp_path / f"{identity}.log",
            identity,
            list(extra),
        ).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
    for p in started:
        if os.environ.get("CARVE_SHOW_CONTROLLER_LOG"):
            print(p.log.read_text())


@pytest.fixture
def gpu_nodes(
    k8s_api: ApiClient,  # noqa: F811
    fake_node: Callable[..., str],  # noqa: F811
) -> Iterator[Callable[[list[str]], str]]:
    """make(models) -> a heartbeating fake node publishing one GPU per model."""
    made: list[str] = []

    def make(models: list[str]) -> str:
        name = fake_node()
        publish_node_gpus(k8s_api, name, models)
        made.append(name)
        return name

    yield make
    for n in made:
        delete_node_slices(k8s_api, n)
