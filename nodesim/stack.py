"""carve installed on a local control plane: DeviceClasses, the admission gate, the controller
process and simulated GPU nodes. Shared by the end-to-end suite, the demo and the latency
benchmark (test tooling; nothing here ships).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from devcluster.cluster import api_client_for, run_kubectl
from devcluster.nodes import NodeHeartbeater
from devcluster.processes import ManagedProcess, console_script, tail_of
from driver.contract import DEFAULT_CONTRACT, Contract
from nodesim.simnode import SimNode, SimNodeSpec
from process.kube.jsonclient import KubeJson

_log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "deploy" / "manifests"
EXAMPLES = REPO / "deploy" / "examples"
# What a cluster needs from deploy/manifests when carve runs outside it (no Deployment,
# DaemonSet or RBAC: the processes run here with the admin kubeconfig, so the policies that
# name carve-controller's service account name that user instead, see `CarveStack.install`).
INSTALL_MANIFESTS = (
    "00-namespace.yaml",
    "10-deviceclasses.yaml",
    "30-admission-gate.yaml",
    "31-sole-allocator.yaml",
    "32-claim-finalizer.yaml",
)
_CONTROLLER_ACCOUNT = "system:serviceaccount:carve-system:carve-controller"
# The scheduling gate carve's admission policy puts on pods with carve claims.
PLACEMENT_GATE = DEFAULT_CONTRACT.scheduling_gate
_GATE_POLICY_PREFIX = "carve-placement-gate"


_EXTENDED_PREFIX = (
    "nvidia.com/mig-"  # the chart's default deviceClasses.extendedResources.migPrefix
)
_WHOLE_GPU_RESOURCE = (
    "nvidia.com/gpu"  # the chart's default deviceClasses.extendedResources.wholeGpu
)


def render_manifest(text: str, contract: Contract) -> str:
    """deploy/manifests/ as a cluster running carve under `contract.driver` needs them.

    The shipped files spell the default names; a renamed install gets every class, attribute
    domain and gate renamed, and its admission policies a name of their own, so that it can
    share a cluster with a default install. This is what the Helm chart's driver-name value
    does; until the chart exists the test tooling renders the same way."""
    if contract == DEFAULT_CONTRACT:
        return text
    slug = contract.driver.replace(".", "-")
    return (
        text.replace(DEFAULT_CONTRACT.gpu_class, contract.gpu_class)
        .replace(DEFAULT_CONTRACT.driver, contract.driver)
        .replace(_GATE_POLICY_PREFIX, f"{_GATE_POLICY_PREFIX}-{slug}")
        .replace("carve-sole-allocator", f"carve-sole-allocator-{slug}")
        .replace("carve-claim-markers", f"carve-claim-markers-{slug}")
        .replace("carve-claim-finalizer", f"carve-claim-finalizer-{slug}")
        # The chart's migPrefix and wholeGpu: two installs naming one extended resource would
        # take each other's pods (kube-scheduler maps a name to the newest class), so each gets
        # its own.
        .replace(_EXTENDED_PREFIX, f"{contract.driver}/mig-")
        .replace(
            f"extendedResourceName: {_WHOLE_GPU_RESOURCE}\n",
            f"extendedResourceName: {contract.driver}/gpu\n",
        )
        .replace(f'"{_WHOLE_GPU_RESOURCE}"]', f'"{contract.driver}/gpu"]')
    )


def gates_pod(
    api: KubeJson,
    namespace: str,
    claim_ref: Mapping[str, str],
    gate: str = PLACEMENT_GATE,
) -> bool:
    """Whether carve's admission gate would gate a pod in `namespace` naming `claim_ref`
    (``resourceClaimName`` or ``resourceClaimTemplateName``) right now.

    The admission policy takes effect, and sees new claims and templates, only once the
    apiserver's informers have them; a dry-run create asks without leaving a pod behind."""
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "carve-gate-probe"},
        "spec": {
            "resourceClaims": [{"name": "c", **claim_ref}],
            "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "c"}]}}],
        },
    }
    pod = api.request(
        "POST", f"/api/v1/namespaces/{namespace}/pods", body=probe, query=[("dryRun", "All")]
    )
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == gate for g in gates)


class CarveStack:
    """One carve installation. `detached` processes outlive this Python process (the demo)."""

    def __init__(
        self,
        kubeconfig: Path,
        root: Path,
        *,
        detached: bool = False,
        contract: Contract = DEFAULT_CONTRACT,
    ) -> None:
        self.contract = contract
        self.kubeconfig = kubeconfig
        self.root = root
        self.detached = detached
        self.api = api_client_for(kubeconfig)
        self.heartbeater = NodeHeartbeater(self.api).start()
        self.nodes: dict[str, SimNode] = {}
        self._controller: ManagedProcess | None = None
        self._user: str | None = None
        root.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to 107 bytes; node directories hold the plugin's sockets.
        self.nodes_dir = root / "nodes"
        self._temp_nodes_dir = len(str(self.nodes_dir)) > 40
        if self._temp_nodes_dir:
            self.nodes_dir = Path(tempfile.mkdtemp(prefix="carve-nodes-", dir="/tmp"))
        self._node_serial = 0

    # -- install -------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = run_kubectl(self.kubeconfig, *args, check=False, input=input, timeout=120)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed:\n{done.stderr or done.stdout}")
        return done

    def install(
        self,
        manifests: Iterable[str] = INSTALL_MANIFESTS,
        *,
        gate_namespaces: Mapping[str, str] | None = None,
        controller_user: str | None = None,
    ) -> None:
        """Apply carve's cluster objects. With `gate_namespaces` (labels), the admission gate's
        bindings only match namespaces carrying those labels, so a test suite sharing the
        control plane with others gates only its own pods. The policies that let only
        carve-controller allocate carve's claims name `controller_user` (by default the user
        of this stack's kubeconfig, which `start_controller` runs as)."""
        for name in manifests:
            text = render_manifest((MANIFESTS / name).read_text(), self.contract)
            text = text.replace(_CONTROLLER_ACCOUNT, controller_user or self.user())
            docs = [d for d in yaml.safe_load_all(text) if d]
            if gate_namespaces is not None:
                for doc in docs:
                    if doc.get("kind") == "MutatingAdmissionPolicyBinding":
                        doc["spec"]["matchResources"] = {
                            "namespaceSelector": {"matchLabels": dict(gate_namespaces)}
                        }
            self.kubectl(
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                "-",
                input=yaml.safe_dump_all(docs, sort_keys=False),
            )
        self._wait_for_admission_policy(gate_namespaces or {})

    def user(self) -> str:
        """Who the processes here run as (the kubeconfig's user): carve-controller's identity
        to the admission policies that let only carve-controller allocate carve's claims."""
        if self._user is None:
            review = KubeJson(self.api).request(
                "POST",
                "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            )
            self._user = str(review["status"]["userInfo"]["username"])
        return self._user

    def _wait_for_admission_policy(self, labels: Mapping[str, str], timeout: float = 30.0) -> None:
        """The apiserver applies a new MutatingAdmissionPolicy only after its informers see it
        (about a second). Probe with a dry-run pod until the gate is added."""
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "carve-gate-probe"},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "r", "exactly": {"deviceClassName": self.contract.mig_class}}
                    ]
                }
            },
        }
        api = KubeJson(self.api)
        ns = "carve-system"
        if labels:
            ns = "carve-gate-probe"
            with contextlib.suppress(Exception):  # exists from an earlier install: fine
                api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
            api.request(
                "PATCH",
                f"/api/v1/namespaces/{ns}",
                body={"metadata": {"labels": dict(labels)}},
                content_type="application/merge-patch+json",
            )
        claims = f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
        with contextlib.suppress(Exception):  # left over from an earlier run: fine
            api.request("POST", claims, body=claim)
        deadline = time.monotonic() + timeout
        try:
            while True:
                ref = {"resourceClaimName": "carve-gate-probe"}
                if gates_pod(api, ns, ref, self.contract.scheduling_gate):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError("the carve admission gate did not take effect in time")
                time.sleep(0.3)
        finally:
            with contextlib.suppress(Exception):
                api.request("DELETE", f"{claims}/carve-gate-probe")

    # -- controller ----------------------------------------------------------------------------

    @property
    def controller_log(self) -> Path:
        return self.root / "carve-controller.log"

    def start_controller(self, *extra: str) -> None:
        if self.controller_running():
            raise RuntimeError("carve-controller is already running")
        argv = [
            *console_script("carve-controller", "controller.main"),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--http-address=127.0.0.1:0",
            "--retry-interval=3s",
            "--log-format=text",
            f"--driver-name={self.contract.driver}",
            *extra,
        ]
        self._controller = ManagedProcess(
            "carve-controller", argv, self.controller_log, tie_to_parent=not self.detached
        )

    def controller_running(self) -> bool:
        return self._controller is not None and self._controller.exit_code() is None

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        if self._controller is not None:
            self._controller.kill(sig)

    def controller_log_tail(self, lines: int = 40) -> str:
        return tail_of(self.controller_log, lines)

    # -- nodes ---------------------------------------------------------------------------------

    def add_node(self, spec: SimNodeSpec) -> SimNode:
        self._node_serial += 1
        node = SimNode(
            spec,
            self.nodes_dir / f"n{self._node_serial}-{spec.name[-12:].strip('-')}",
            self.kubeconfig,
            self.api,
            self.heartbeater,
            detached=self.detached,
            driver=self.contract.driver,
        )
        try:
            node.start()
        except BaseException:
            with contextlib.suppress(Exception):
                node.stop()
            raise
        self.nodes[spec.name] = node
        return node

    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name)
        node.stop()

    # -- teardown ------------------------------------------------------------------------------

    def stop(self, *, delete_nodes: bool = True) -> None:
        for name in list(self.nodes):
            node = self.nodes.pop(name)
            try:
                node.stop(delete=delete_nodes)
            except Exception:
                _log.exception("stopping node %s failed", name)
        if self._controller is not None:
            self._controller.stop(grace_seconds=10.0)
        self.heartbeater.stop()
        if self._temp_nodes_dir and not self.detached and delete_nodes:
            shutil.rmtree(self.nodes_dir, ignore_errors=True)
