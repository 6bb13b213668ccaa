"""The chart against the real control plane: server-side dry runs of what it renders, then
helm install, upgrade and uninstall of a default and a renamed install side by side.

There are no kubelets here, so the components are kept from running by a nodeSelector that
matches no node: the Deployment's pods stay Pending, the DaemonSet schedules none. What is
checked is what the apiserver does with the chart's objects: it accepts them (schemas, CEL of
the DeviceClasses and admission policies, RBAC), the admission gate gates a pod that uses a
carve class, an upgrade with another value rolls both pod templates, and an uninstall leaves
no DeviceClass, admission policy or RBAC object behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.cluster import LocalCluster, api_client_for, run_kubectl
from devcluster.waiting import wait_for
from driver.contract import Contract
from nodesim.stack import MANIFESTS, gates_pod
from process.kube.jsonclient import KubeJson
from tests.support.helm import CHART, Helm

pytestmark = pytest.mark.cluster

NOWHERE = {"carve.dev/test-no-such-node": "true"}
# Both components kept off every node: nothing needs a kubelet.
PARKED = {"controller": {"nodeSelector": NOWHERE}, "plugin": {"nodeSelector": NOWHERE}}
# Everything optional turned on, for the dry runs.
EVERYTHING = (
    "deviceClasses.profiles={1g.10gb,3g.40gb}",
    "metrics.serviceMonitor.enabled=true",
    "plugin.simulate.enabled=true",
    "plugin.driverRoot=/run/nvidia/driver",
    "plugin.devRoot=/run/nvidia/driver",
    "admissionGate.namespaceSelector.matchLabels.carve=on",
    "controller.replicas=1",
)
# What the Prometheus Operator would install; enough for the apiserver to take ServiceMonitors.
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}
# Every kind the chart creates, for "nothing is left behind".
CHART_KINDS = (
    "deviceclasses,mutatingadmissionpolicies,mutatingadmissionpolicybindings,"
    "validatingadmissionpolicies,validatingadmissionpolicybindings,clusterroles,"
    "clusterrolebindings,roles,rolebindings,serviceaccounts,configmaps,services,"
    "deployments,daemonsets,servicemonitors"
)


class Kube:
    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.api = KubeJson(api_client_for(kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        done = run_kubectl(self.kubeconfig, *args, input=input, check=False, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}:\n{done.stderr}{done.stdout}")
        return done.stdout + done.stderr

    def get(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def ensure_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        if labels:
            doc["metadata"]["labels"] = labels
        self.kubectl("apply", "-f", "-", input=json.dumps(doc))


@pytest.fixture(scope="module")
def kube(k8s_cluster: LocalCluster) -> Kube:
    kube = Kube(Path(k8s_cluster.info.kubeconfig))
    kube.kubectl("apply", "-f", "-", input=json.dumps(SERVICE_MONITOR_CRD))
    kube.kubectl("wait", "--for=condition=Established", "crd/servicemonitors.monitoring.coreos.com")
    return kube


@pytest.fixture
def parked_values(tmp_path: Path) -> Path:
    path = tmp_path / "parked.yaml"
    path.write_text(yaml.safe_dump(PARKED))
    return path


def test_the_plain_manifests_pass_a_server_dry_run(kube: Kube) -> None:
    kube.ensure_namespace("carve-system")  # a dry run creates no namespace for what is in it
    out = kube.kubectl("apply", "--dry-run=server", "-f", str(MANIFESTS))
    assert "deviceclass.resource.k8s.io/mig.carve.dev created (server dry run)" in out, out


@pytest.mark.parametrize(
    ("namespace", "sets"),
    [
        ("carve-system", ()),
        ("carve-everything", EVERYTHING),
        ("carve-example", ("driverName=mig.example.com", *EVERYTHING)),
    ],
    ids=["defaults", "everything-on", "renamed"],
)
def test_what_the_chart_renders_passes_a_server_dry_run(
    kube: Kube, helm: Helm, namespace: str, sets: tuple[str, ...]
) -> None:
    kube.ensure_namespace(namespace)
    args = ["template", "carve", str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    rendered = helm.run(*args).stdout
    out = kube.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)
    created = [line for line in out.splitlines() if line.endswith("(server dry run)")]
    assert len(created) == len([d for d in yaml.safe_load_all(rendered) if d]), out


def test_bad_values_fail_helm_install_before_anything_is_created(kube: Kube, helm: Helm) -> None:
    done = helm.run(
        "install",
        "carve-bad",
        str(CHART),
        "--namespace",
        "carve-bad",
        "--create-namespace",
        "--set",
        "plugin.foreignInstances=destroy",
        kubeconfig=str(kube.kubeconfig),
        check=False,
    )
    assert done.returncode != 0
    assert "at '/plugin/foreignInstances': value must be one of 'adopt', 'leave', 'refuse-gpu'" in (
        done.stderr
    )
    listed = helm.run("list", "--all-namespaces", "-q", kubeconfig=str(kube.kubeconfig))
    assert "carve-bad" not in listed.stdout
    assert not kube.kubectl(
        "get", CHART_KINDS, "-A", "-l", "app.kubernetes.io/instance=carve-bad", "-o", "name"
    ).strip()


@pytest.fixture
def releases(kube: Kube, helm: Helm) -> Iterator[list[tuple[str, str]]]:
    """(release, namespace) pairs installed by the test; uninstalled if the test did not."""
    installed: list[tuple[str, str]] = []
    yield installed
    for release, namespace in installed:
        helm.run(
            "uninstall",
            release,
            "--namespace",
            namespace,
            "--ignore-not-found",
            kubeconfig=str(kube.kubeconfig),
            check=False,
        )


WORKLOADS = {"deployment": "carve-controller", "daemonset": "carve-kubelet-plugin"}


def _checksum(kube: Kube, kind: str, namespace: str) -> str:
    obj = kube.get(kind, "-n", namespace, WORKLOADS[kind])
    return str(obj["spec"]["template"]["metadata"]["annotations"]["checksum/config"])


def test_install_upgrade_and_uninstall(
    kube: Kube, helm: Helm, parked_values: Path, releases: list[tuple[str, str]]
) -> None:
    cfg = str(kube.kubeconfig)
    default, renamed = Contract(), Contract("mig.example.com")
    installs = {
        "carve": ("carve-system", default, ()),
        "carve-example": (
            "carve-example",
            renamed,
            (
                "--set",
                f"driverName={renamed.driver}",
                "--set",
                f"deviceClasses.extendedResources.migPrefix={renamed.driver}/mig-",
            ),
        ),
    }
    for release, (namespace, _, extra) in installs.items():
        helm.run(
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--create-namespace",
            "-f",
            str(parked_values),
            *extra,
            kubeconfig=cfg,
        )
        releases.append((release, namespace))

    # Both installs side by side: each has its classes, gate policies and confining policy.
    classes = {d["metadata"]["name"] for d in kube.get("deviceclasses")["items"]}
    assert default.default_classes | renamed.default_classes <= classes
    policies = {d["metadata"]["name"] for d in kube.get("mutatingadmissionpolicies")["items"]}
    assert {
        "carve-placement-gate-templates",
        "carve-placement-gate-claims",
        "carve-placement-gate-mig-example-com-templates",
        "carve-placement-gate-mig-example-com-claims",
    } <= policies
    vaps = {d["metadata"]["name"] for d in kube.get("validatingadmissionpolicies")["items"]}
    assert {
        "carve-kubelet-plugin-own-node-slices",
        "carve-kubelet-plugin-own-node-slices-mig-example-com",
    } <= vaps

    # The installed gate gates a pod whose template uses the installed class.
    kube.ensure_namespace("carve-helm-gate")
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-slice", "namespace": "carve-helm-gate"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "r", "exactly": {"deviceClassName": renamed.mig_class}}]
                }
            }
        },
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(template))
    ref = {"resourceClaimTemplateName": "one-slice"}
    wait_for(
        "the renamed install's gate to gate a pod using its class",
        lambda: gates_pod(kube.api, "carve-helm-gate", ref, gate=renamed.scheduling_gate),
        timeout=30,
    )
    assert not gates_pod(kube.api, "carve-helm-gate", ref, gate=default.scheduling_gate)

    # Nothing runs anywhere: the DaemonSet is scheduled on no node.
    def scheduled_nowhere() -> bool:
        status = kube.get("daemonset", "-n", "carve-system", "carve-kubelet-plugin")["status"]
        return "desiredNumberScheduled" in status and status["desiredNumberScheduled"] == 0

    wait_for("the DaemonSet to be scheduled on no node", scheduled_nowhere, timeout=30)

    # An upgrade with another value rolls both components (their pod templates change).
    before = {k: _checksum(kube, k, "carve-system") for k in WORKLOADS}
    generation = kube.get("deployment", "-n", "carve-system", "carve-controller")["metadata"][
        "generation"
    ]
    helm.run(
        "upgrade",
        "carve",
        str(CHART),
        "--namespace",
        "carve-system",
        "-f",
        str(parked_values),
        "--set",
        "logging.level=debug",
        kubeconfig=cfg,
    )
    after = {k: _checksum(kube, k, "carve-system") for k in WORKLOADS}
    assert all(before[k] != after[k] for k in before), (before, after)
    deployment = kube.get("deployment", "-n", "carve-system", "carve-controller")
    assert deployment["metadata"]["generation"] > generation
    config = kube.get("configmap", "-n", "carve-system", "carve-controller")["data"]
    assert config["CARVE_LOG_LEVEL"] == "debug"
    status = helm.run("status", "carve", "--namespace", "carve-system", kubeconfig=cfg).stdout
    assert "REVISION: 2" in status, status

    # Uninstall leaves nothing of either release behind.
    for release, (namespace, _, _) in installs.items():
        helm.run(
            "uninstall",
            release,
            "--namespace",
            namespace,
            "--wait",
            "--cascade",
            "foreground",
            "--timeout",
            "60s",
            kubeconfig=cfg,
        )
    releases.clear()
    for release in installs:
        left = kube.kubectl(
            "get", CHART_KINDS, "-A", "-l", f"app.kubernetes.io/instance={release}", "-o", "name"
        )
        assert not left.strip(), left
    for contract in (default, renamed):  # the README's check (no plugin ran, so none here)
        slices = kube.get("resourceslices", f"--field-selector=spec.driver={contract.driver}")
        assert slices["items"] == []
    classes = {d["metadata"]["name"] for d in kube.get("deviceclasses")["items"]}
    assert not classes & (default.default_classes | renamed.default_classes)
    for kinds in (
        "mutatingadmissionpolicies",
        "validatingadmissionpolicies",
        "clusterroles",
        "clusterrolebindings",
    ):
        names = {d["metadata"]["name"] for d in kube.get(kinds)["items"]}
        assert not {n for n in names if n.startswith("carve-")}, (kinds, names)
    wait_for(
        "the gate to be gone",
        lambda: not gates_pod(kube.api, "carve-helm-gate", ref, gate=renamed.scheduling_gate),
        timeout=30,
    )
