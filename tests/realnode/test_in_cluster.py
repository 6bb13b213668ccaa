"""carve inside the cluster, installed, used, upgraded and uninstalled as docs/guide/install.md
says: every ``$`` line of that page runs here, in order, and its output is checked. The chart's
Deployment and DaemonSet run carve's own image (built from this checkout by
deploy/image/build.py) through containerd on a real node, with only the chart's service
accounts and RBAC, and a user pod gets a carved slice end to end.

The page is changed in three ways only: helm gets one more values file (``values()`` below),
the driver and the release namespace are renamed (``RENAMES``), and the workload's commands
run in a namespace of their own.

The node is a real kubelet and containerd without a host-run plugin: the chart's DaemonSet is
the plugin. What this machine lacks is kube-proxy, and the control plane listens on loopback,
so both components run on the host network with the chart's ``apiServer`` set (the setting a
cluster without kube-proxy uses). The install has a driver name of its own, so it can share
the control plane with the other suites' carve.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from devcluster.cluster import LocalCluster, api_client_for, run_kubectl
from devcluster.waiting import wait_for
from driver.config import API_VERSION, KIND_MIG_DEVICE_CONFIG
from driver.contract import Contract
from driver.nvml.sim.mpscontrol import CONTROL_LOG
from kubeletplugin.mpspods import POD_PREFIX
from nodesim.simnode import read_hardware
from realnode.binaries import NodeBinariesUnavailableError, ensure_node_binaries
from realnode.cluster import RealNodes
from realnode.images import TEST_IMAGE, ImageArchive, default_cache
from realnode.node import RealNode, RealNodeSpec, free_ports
from tests.support.guide import Step, expected_in, read_page, run_step
from tests.support.helm import CHART, REPO, Helm, helm_binary

pytestmark = pytest.mark.realnode

PAGE = REPO / "docs" / "guide" / "install.md"
_READS = {"get", "logs", "describe", "wait"}

CONTRACT = Contract("mig.incluster.carve.dev")
IMAGE = "carve.local/carve:incluster"
NODE = "rn-incluster"
NAMESPACE = "carve-incluster"
USER_NAMESPACE = "incluster-user"
GATED = {"carve-incluster": "on"}
RENAMES = (
    ("mig.carve.dev", CONTRACT.driver),
    ("gpu.carve.dev", CONTRACT.gpu_class),
    ("carve-system", NAMESPACE),
)
GPU = "H100-SXM5-80GB"
SIMULATOR = {"gpus": [GPU], "options": {"latency": "zero"}}


def _renamed(text: str) -> str:
    for old, new in RENAMES:
        text = text.replace(old, new)
    return text


def _for_this_node(text: str) -> str:
    """The page's files with the local test image and this suite's node."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    for d in docs:
        if d.get("kind") == "Pod":
            d["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE}
            for c in d["spec"]["containers"]:
                c["image"], c["imagePullPolicy"] = TEST_IMAGE, "IfNotPresent"
    return yaml.safe_dump_all(docs)


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
        self.values_file = Path()

    def run(self, step: Step, files: Path) -> str:
        """One ``$`` line of the page, renamed, with the test's values file given to helm;
        read-only commands are asked again until what the page shows has happened."""
        argv = shlex.split(_renamed(step.command))
        renamed = Step(step.command, tuple(_renamed(e) for e in step.expected))
        if argv[0] == "helm":
            args = [str(CHART) if a == "deploy/helm/carve" else a for a in argv[1:]]
            if args[0] in ("install", "upgrade"):
                args += ["-f", str(self.values_file)]

            def attempt() -> subprocess.CompletedProcess[str]:
                return self.helm.run(*args, kubeconfig=str(self.kubeconfig), check=False)

        elif argv[0] == "kubectl":
            args = [str(files / a) if argv[i] == "-f" else a for i, a in enumerate(argv[1:])]
            if "-n" not in args and "--namespace" not in args:
                args += ["-n", USER_NAMESPACE]

            def attempt() -> subprocess.CompletedProcess[str]:
                return run_kubectl(self.kubeconfig, *args, check=False, timeout=240)

        else:
            raise AssertionError(f"the page may only run helm and kubectl: {step.command}")
        return run_step(
            step,
            attempt,
            expected_in(renamed, USER_NAMESPACE),
            retry=argv[1] in _READS,
            diagnostics=self.diagnostics,
        )

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
            # A second install in one cluster names its own extended resources (the newest
            # class would take nvidia.com/mig-* from the suite's carve; deploy/README.md).
            "deviceClasses": {"extendedResources": {"migPrefix": f"{CONTRACT.driver}/mig-"}},
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
        env.values_file = tmp_path_factory.mktemp("incluster") / "values.yaml"
        env.values_file.write_text(yaml.safe_dump(env.values(k8s_cluster.info.server)))
        installed = True
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


def test_the_install_page_runs_as_written(incluster: InCluster, tmp_path: Path) -> None:
    env = incluster
    page = read_page(PAGE)
    assert "first-slice.yaml" in page.files
    for name, text in page.files.items():
        (tmp_path / name).write_text(_for_this_node(_renamed(text)))
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
    first_workload = next(i for i, s in enumerate(page.steps) if "first-slice" in s.command)
    for step in page.steps[:first_workload]:
        env.run(step, tmp_path)

    # Installed: both components run carve's image, as the chart's own service accounts.
    for component in ("carve-kubelet-plugin", "carve-controller"):
        (pod,) = env.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/name={component}")[
            "items"
        ]
        assert pod["spec"]["serviceAccountName"] == component
        assert pod["spec"]["containers"][0]["image"] == IMAGE
        assert pod["spec"]["nodeName"] == NODE

    for step in page.steps[first_workload:]:
        env.run(step, tmp_path)
        if step.command.startswith("kubectl logs first-slice"):
            (claim,) = env.get("resourceclaims", "-n", USER_NAMESPACE)["items"]
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["pool"] == NODE
            assert "-mig-1g10gb-" in result["device"]
    # Uninstalled: no slice is left on the GPU, nothing of the release in the cluster.
    assert env.instances() == 0
    assert not env.get("all", "-n", NAMESPACE)["items"]


# An MPS client that asks the claim's daemon twice a second, for as long as it runs: each line
# says when it asked (host clock) and what came back.
_MPS_CLIENT = """\
while true; do
  r=$(echo get_default_active_thread_percentage | nvidia-cuda-mps-control 2>&1)
  echo "QUERY $(date +%s) [$r]"
  sleep 0.5
done
"""


def _mps_workload() -> str:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "shared-mps"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "slice",
                        "exactly": {
                            "deviceClassName": CONTRACT.mig_class,
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": f'device.attributes["{CONTRACT.driver}"]'
                                        '.profile == "1g.10gb"'
                                    }
                                }
                            ],
                        },
                    }
                ],
                "config": [
                    {
                        "opaque": {
                            "driver": CONTRACT.driver,
                            "parameters": {
                                "apiVersion": API_VERSION,
                                "kind": KIND_MIG_DEVICE_CONFIG,
                                "sharing": {
                                    "strategy": "MPS",
                                    "mpsConfig": {"defaultActiveThreadPercentage": 40},
                                },
                            },
                        }
                    }
                ],
            }
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "mps-client"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared-mps"}],
            "containers": [
                {
                    "name": "worker",
                    "image": TEST_IMAGE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", _MPS_CLIENT],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    return yaml.safe_dump_all([claim, pod])


def _plugin_pod(env: InCluster) -> dict[str, Any]:
    (pod,) = env.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=carve-kubelet-plugin")[
        "items"
    ]
    return dict(pod)


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _queries(env: InCluster) -> list[tuple[int, str]]:
    """(when, reply) of each query the client has logged so far."""
    out = []
    for line in env.kubectl("logs", "mps-client", "-n", USER_NAMESPACE).splitlines():
        if line.startswith("QUERY "):
            when, _, reply = line.removeprefix("QUERY ").partition(" ")
            out.append((int(when), reply))
    return out


def test_an_mps_daemon_outlives_the_plugin_pod(incluster: InCluster) -> None:
    """Issue 32, point 5: the plugin's pod is deleted (as a crash, an eviction or a chart
    upgrade replaces it) while a pod uses an MPS claim. The client keeps its daemon, the same
    one, answering all along, and the new plugin adopts it instead of starting another."""
    env = incluster
    env.helm.run(
        "install", "carve", str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "-f", str(env.values_file), "--set", "plugin.cleanupOnExit=true",
        "--set", "logging.format=json", "--wait",
        "--timeout", "300s", kubeconfig=str(env.kubeconfig),
    )  # fmt: skip
    try:
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
        env.kubectl("apply", "-n", USER_NAMESPACE, "-f", "-", input=_mps_workload())
        env.kubectl(
            "wait", "-n", USER_NAMESPACE, "--for=condition=Ready", "pod/mps-client",
            "--timeout=180s",
        )  # fmt: skip
        wait_for("the client's first answer", lambda: _queries(env), 60)
        claim = env.get("resourceclaim", "shared-mps", "-n", USER_NAMESPACE)
        uid = claim["metadata"]["uid"]
        daemon_pod = f"{POD_PREFIX}{uid}"
        before = env.get("pod", daemon_pod, "-n", NAMESPACE)
        (status,) = before["status"]["containerStatuses"]
        assert before["spec"]["nodeName"] == NODE and "running" in status["state"]
        log = env.node.layout.plugins_dir / CONTRACT.driver / "mps" / uid / "log" / CONTROL_LOG
        assert log.read_text().count("Starting control daemon") == 1

        old = _plugin_pod(env)
        deleted_at = time.time()
        env.kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=true")

        def new_plugin_ready() -> dict[str, Any] | None:
            pods = env.get(
                "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=carve-kubelet-plugin"
            )["items"]
            fresh = [p for p in pods if p["metadata"]["uid"] != old["metadata"]["uid"]]
            return fresh[0] if len(fresh) == 1 and _ready(fresh[0]) else None

        new = wait_for("the new plugin pod to be Ready", new_plugin_ready, 180)
        ready_at = time.time()
        # The client asked all along, before, while no plugin ran, and after; every answer came
        # from a daemon with the claim's setting.

        def answers_after_ready() -> list[tuple[int, str]] | None:
            queries = _queries(env)
            return queries if queries[-1][0] > ready_at + 2 else None

        queries = wait_for("answers after the new plugin is ready", answers_after_ready, 60)
        since = [reply for when, reply in queries if when >= deleted_at]
        assert since and all(reply == "[40.0]" for reply in since), since
        # The same daemon: its pod and its container were never replaced, nothing restarted it.
        after = env.get("pod", daemon_pod, "-n", NAMESPACE)
        (status_after,) = after["status"]["containerStatuses"]
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert status_after["containerID"] == status["containerID"]
        assert status_after["restartCount"] == 0 and "running" in status_after["state"]
        assert log.read_text().count("Starting control daemon") == 1
        events = env.get("events", "-n", USER_NAMESPACE)["items"]
        assert not [e for e in events if e.get("reason", "").startswith("MPSDaemon")], events
        # ... and the new plugin took it over.
        logs = env.kubectl("logs", "-n", NAMESPACE, new["metadata"]["name"])
        lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        adopted = [e for e in lines if e["msg"] == "MPS control daemon adopted"]
        assert [(e["claimUID"], e["daemon"]) for e in adopted] == [
            (uid, f"pod {NAMESPACE}/{daemon_pod}")
        ], logs[-3000:]

        # The pod and the claim go: the daemon's pod first, then the slice.
        env.kubectl("delete", "-n", USER_NAMESPACE, "pod/mps-client", "resourceclaim/shared-mps")
        wait_for(
            "the daemon pod to go",
            lambda: (
                not env.kubectl(
                    "get", "pod", daemon_pod, "-n", NAMESPACE, "--ignore-not-found", "-o", "name"
                )
            ),
            120,
        )
        wait_for("the slice to be destroyed", lambda: env.instances() == 0, 120)
    finally:
        env.helm.run(
            "uninstall", "carve", "--namespace", NAMESPACE, "--wait",
            kubeconfig=str(env.kubeconfig), check=False,
        )  # fmt: skip
