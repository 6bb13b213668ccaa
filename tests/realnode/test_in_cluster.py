"""carve inside the cluster: the Helm chart's Deployment and DaemonSet run carve's own image
(built from this checkout by deploy/image/build.py) through containerd on a real node, with
only the chart's service accounts and RBAC, and a user pod gets a carved slice end to end.

The node is a real kubelet and containerd without a host-run plugin: the chart's DaemonSet is
the plugin. What this machine lacks is kube-proxy, and the control plane listens on loopback,
so both components run on the host network with the chart's ``apiServer`` set (the setting a
cluster without kube-proxy uses). The install has a driver name of its own, so it can share
the control plane with the other suites' carve.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from devcluster.cluster import LocalCluster, api_client_for, run_kubectl
from devcluster.waiting import wait_for
from driver.contract import Contract
from nodesim.simnode import read_hardware
from realnode.binaries import NodeBinariesUnavailableError, ensure_node_binaries
from realnode.cluster import RealNodes
from realnode.images import TEST_IMAGE, ImageArchive, default_cache
from realnode.node import RealNode, RealNodeSpec, free_ports
from tests.deploy.conftest import CHART, REPO, Helm, helm_binary

pytestmark = pytest.mark.realnode

CONTRACT = Contract("mig.incluster.carve.dev")
IMAGE = "carve.local/carve:incluster"
NODE = "rn-incluster"
NAMESPACE = "carve-incluster"
USER_NAMESPACE = "incluster-user"
GATED = {"carve-incluster": "on"}
GPU = "H100-SXM5-80GB"
SIMULATOR = {"gpus": [GPU], "options": {"latency": "zero"}}


def _require(reason: str) -> None:
    if os.environ.get("CARVE_REQUIRE_CLUSTER"):
        raise RuntimeError(
            f"CARVE_REQUIRE_CLUSTER is set but carve cannot run in-cluster: {reason}"
        )
    pytest.skip(reason)


def _image() -> ImageArchive:
    """carve's image from this checkout (the Debian base comes from the cache when warm)."""
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        _require("building carve's image needs root and mmdebstrap (make image)")
    output = default_cache() / "carve-incluster.oci.tar"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "deploy/image/build.py"),
            "--name",
            IMAGE,
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=1500,
    )
    if done.returncode != 0:
        raise RuntimeError(f"deploy/image/build.py failed:\n{done.stderr[-3000:]}")
    return ImageArchive(IMAGE, output)


class InCluster:
    def __init__(self, cluster: LocalCluster, node: RealNode, helm: Helm) -> None:
        self.kubeconfig = Path(cluster.info.kubeconfig)
        self.node = node
        self.helm = helm
        self.state_dir = node.layout.root / "simulator"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        done = run_kubectl(self.kubeconfig, *args, input=input, check=False, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)}:\n{done.stderr}{done.stdout}\n{self.diagnostics()}"
            )
        return done.stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def values(self, server: str) -> dict[str, Any]:
        url = urlparse(server)
        controller_port, plugin_port = free_ports(2)
        lay = self.node.layout
        here = {"kubernetes.io/hostname": NODE}
        return {
            "driverName": CONTRACT.driver,
            "image": {
                "repository": IMAGE.rsplit(":", 1)[0],
                "tag": IMAGE.rsplit(":", 1)[1],
                "pullPolicy": "Never",
            },
            "apiServer": {"host": url.hostname, "port": url.port},
            "admissionGate": {"namespaceSelector": {"matchLabels": GATED}},
            "logging": {"format": "text", "level": "info"},
            "controller": {
                "replicas": 1,
                "hostNetwork": True,
                "httpPort": controller_port,
                "nodeSelector": here,
            },
            "plugin": {
                "hostNetwork": True,
                "httpPort": plugin_port,
                "nodeSelector": here,
                "kubeletDir": str(lay.kubelet_root),
                "cdiDir": str(lay.cdi_dir),
                "driverRoot": str(lay.driver_root),
                "devRoot": str(lay.dev_root),
                "resyncPeriod": "10s",
                "simulate": {
                    "enabled": True,
                    "stateDir": str(self.state_dir),
                    "config": SIMULATOR,
                },
            },
        }

    def hardware(self) -> dict[str, Any]:
        """The simulated GPUs' state, read with the config the chart gives the plugin."""
        config = self.state_dir / "read.yaml"
        sim = {**SIMULATOR, "state": str(self.state_dir / "state.json"), "uuid_seed": NODE}
        config.write_text(yaml.safe_dump(sim))
        return read_hardware(config)

    def instances(self) -> int:
        return sum(len(g["gis"]) for g in self.hardware()["gpus"])

    def diagnostics(self) -> str:
        parts = [self.node.log_tails(40)]
        for what in (("daemonsets", "-n", NAMESPACE, "-o", "yaml"), ("nodes", "--show-labels")):
            done = run_kubectl(self.kubeconfig, "get", *what, check=False)
            parts.append(f"--- {what[0]} ---\n{done.stdout[-3000:]}{done.stderr}")
        for ns in (NAMESPACE, USER_NAMESPACE):
            done = run_kubectl(
                self.kubeconfig, "get", "pods,events", "-n", ns, "-o", "wide", check=False
            )
            parts.append(f"--- {ns} ---\n{done.stdout}{done.stderr}")
            for pod in ("carve-kubelet-plugin", "carve-controller"):
                logs = run_kubectl(
                    self.kubeconfig,
                    "logs",
                    "-n",
                    ns,
                    "-l",
                    f"app.kubernetes.io/name={pod}",
                    "--tail=40",
                    check=False,
                )
                if logs.stdout:
                    parts.append(f"--- {pod} logs ---\n{logs.stdout}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def incluster(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InCluster]:
    try:
        binaries = ensure_node_binaries()
    except NodeBinariesUnavailableError as exc:
        _require(f"real nodes unavailable: {exc}")
    helm = Helm(helm_binary(), tmp_path_factory.mktemp("helm-home"))
    image = _image()
    kubeconfig = Path(k8s_cluster.info.kubeconfig)
    nodes = RealNodes(
        kubeconfig, api_client_for(kubeconfig), driver=CONTRACT.driver, binaries=binaries
    )
    installed = False
    try:
        node = nodes.add_node(
            RealNodeSpec(NODE, (GPU,), labels={"nvidia.com/gpu.present": "true"}),
            host_plugin=False,
            extra_images=[image],
        )
        env = InCluster(k8s_cluster, node, helm)
        values = tmp_path_factory.mktemp("incluster") / "values.yaml"
        values.write_text(yaml.safe_dump(env.values(k8s_cluster.info.server)))
        installed = True
        done = helm.run(
            "install",
            "carve",
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "-f",
            str(values),
            kubeconfig=str(kubeconfig),
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"helm install: {done.stderr}{done.stdout}\n{env.diagnostics()}")
        yield env
    finally:
        if installed:
            helm.run(
                "uninstall",
                "carve",
                "--namespace",
                NAMESPACE,
                "--wait",
                kubeconfig=str(kubeconfig),
                check=False,
            )
        nodes.stop()


def _ready(env: InCluster, component: str) -> bool:
    pods = env.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={component}")["items"]
    return bool(pods) and all(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
        for p in pods
    )


def test_a_pod_gets_a_slice_from_carve_running_in_its_own_image(incluster: InCluster) -> None:
    env = incluster
    try:
        wait_for("the plugin pod to be Ready", lambda: _ready(env, "carve-kubelet-plugin"), 180)
        wait_for("the controller pod to be Ready", lambda: _ready(env, "carve-controller"), 120)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{env.diagnostics()}") from exc
    for component, account in (
        ("carve-kubelet-plugin", "carve-kubelet-plugin"),
        ("carve-controller", "carve-controller"),
    ):
        (pod,) = env.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={component}")[
            "items"
        ]
        assert pod["spec"]["serviceAccountName"] == account
        assert pod["spec"]["containers"][0]["image"] == IMAGE
        assert pod["spec"]["nodeName"] == NODE

    # The containerised plugin published the node's devices (through the chart's RBAC and past
    # the admission policy that confines it to its own node's slices).
    def published() -> list[Any]:
        items = env.get("resourceslices")["items"]
        return [
            s
            for s in items
            if s["spec"]["driver"] == CONTRACT.driver and s["spec"].get("nodeName") == NODE
        ]

    wait_for("the in-cluster plugin's ResourceSlices", published, 60)

    env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": USER_NAMESPACE, "labels": GATED},
            }
        ),
    )
    expression = f'device.attributes["{CONTRACT.driver}"].profile == "1g.10gb"'
    docs = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-slice", "namespace": USER_NAMESPACE},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "mig",
                                "exactly": {
                                    "deviceClassName": CONTRACT.mig_class,
                                    "selectors": [{"cel": {"expression": expression}}],
                                },
                            }
                        ]
                    }
                }
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "user", "namespace": USER_NAMESPACE},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "one-slice"}],
                "containers": [
                    {
                        "name": "main",
                        "image": TEST_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c", "nvidia-smi -L; sleep 600"],
                        "resources": {"claims": [{"name": "mig"}]},
                    }
                ],
            },
        },
    ]
    env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def running() -> bool:
        pod = env.get("pod", "-n", USER_NAMESPACE, "user")
        return bool(pod["status"].get("phase") == "Running")

    wait_for("the user pod to run", running, 120)
    logs = wait_for(
        "nvidia-smi's output in the pod",
        lambda: (out := env.kubectl("logs", "-n", USER_NAMESPACE, "user")) and "MIG" in out and out,
        30,
    )
    assert "MIG 1g.10gb" in logs, logs
    (claim,) = env.get("resourceclaims", "-n", USER_NAMESPACE)["items"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == CONTRACT.driver and result["pool"] == NODE
    assert env.instances() == 1

    env.kubectl("delete", "pod", "-n", USER_NAMESPACE, "user", "--wait=true")
    wait_for("the slice to be destroyed", lambda: env.instances() == 0, 60)
