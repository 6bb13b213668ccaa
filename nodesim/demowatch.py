"""How `make demo` follows what it started: pods' phases as they change, the described pod's
claim while it is allocated, the admission gate's readiness and the release of the slices.

Split from nodesim/demo.py, which holds the demo's steps; these read the cluster and print.
Dev tooling: nothing here ships with carve.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nodesim.lifecycle import claim_names

EXAMPLES_NAMESPACE = "default"

Kubectl = Callable[..., subprocess.CompletedProcess[str]]
"""How the demo runs kubectl: `devcluster.cluster.run_kubectl` bound to its kubeconfig."""


def _say(text: str = "") -> None:
    print(text, flush=True)


def capacity_line(api: Any, node: str) -> str:
    """What the real kubelet reports: this machine's own cpu and memory, on every node."""
    from process.kube.errors import ApiError
    from process.kube.jsonclient import KubeJson

    try:
        capacity = KubeJson(api).request("GET", f"/api/v1/nodes/{node}")["status"]["capacity"]
    except (ApiError, KeyError):
        return "cpu and memory: this machine's own (each kubelet reports the real capacity)"
    return (
        f"cpu {capacity.get('cpu')}, memory {gib(str(capacity.get('memory')))} on each: this "
        "machine's own (a real kubelet reports the real capacity)"
    )


def gib(quantity: str) -> str:
    """A kubelet memory quantity ("24683652Ki") in GiB, for people."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix) and quantity[: -len(suffix)].isdigit():
            return f"{int(quantity[: -len(suffix)]) * factor / 2**30:.1f}Gi"
    return quantity


def wait_released(api: Any, timeout: float = 30.0) -> bool:
    """Until no ResourceClaim of the examples is allocated any more (True), or ``timeout``."""
    from process.kube.errors import ApiError
    from process.kube.jsonclient import KubeJson

    path = f"/apis/resource.k8s.io/v1/namespaces/{EXAMPLES_NAMESPACE}/resourceclaims"
    deadline = time.monotonic() + timeout
    while True:
        try:
            items = KubeJson(api).request("GET", path).get("items") or []
        except ApiError:
            items = [{"status": {"allocation": "?"}}]
        if not any((c.get("status") or {}).get("allocation") for c in items):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def wait_gate(api: Any, setup: Sequence[dict[str, Any]], timeout: float = 30.0) -> None:
    """The admission policy reads templates and claims from the apiserver's cache: wait until
    a dry-run pod naming each one gets carve's scheduling gate, so no example pod slips by."""
    from nodesim.stack import gates_pod
    from process.kube.jsonclient import KubeJson

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


def wait_pods(
    kubectl: Kubectl,
    names: Sequence[str],
    timeout: float,
    done_phases: Sequence[str] = ("Running",),
    *,
    on_poll: Callable[[Sequence[dict[str, Any]]], None] | None = None,
    shown: dict[str, str] | None = None,
) -> dict[str, str]:
    """Print each pod's phase as it changes (from the phases in ``shown``), until every pod is
    in ``done_phases`` or Failed."""
    settled = (*done_phases, "Failed")
    deadline = time.monotonic() + timeout
    phases: dict[str, str] = {}
    shown = {} if shown is None else shown
    while time.monotonic() < deadline:
        out = kubectl("get", "pods", "-n", EXAMPLES_NAMESPACE, "-o", "json").stdout
        items = json.loads(out)["items"]
        if on_poll is not None:
            on_poll(items)
        for item in items:
            name = item["metadata"]["name"]
            phase = item["status"].get("phase", "?")
            if item["spec"].get("schedulingGates"):
                phase = "Pending (gated: waiting for carve-controller)"
            phases[name] = phase
            if shown.get(name) != phase and name in names:
                node = item["spec"].get("nodeName") or "-"
                _say(f"  {name:<16} {phase:<48} node {node}")
                shown[name] = phase
        if all(phases.get(n) in settled for n in names):
            break
        time.sleep(0.5)
    return phases


class ClaimSnapshot:
    """`kubectl describe` of one pod's claim, taken whenever the allocated claim changes: on
    real nodes the pod runs `nvidia-smi -L` and completes within seconds, and the claim is
    released (and deleted) right after, so the demo keeps the last allocated view."""

    def __init__(self, kubectl: Kubectl, api: Any, pod: str, entry: str) -> None:
        from process.kube.jsonclient import KubeJson

        self._kubectl = kubectl
        self._api = KubeJson(api)
        self.pod = pod
        self.entry = entry
        self.claim: str | None = None
        self.text = ""
        self.devices = 0  # how many devices the claim was allocated
        self._version: str | None = None

    def poll(self, pods: Sequence[Mapping[str, Any]]) -> None:
        # The first name the pod's status gives is the claim the pod runs with: once that
        # claim is deleted (its pod completed), kube-controller-manager may put a new name
        # there, for a claim it deletes again.
        for item in pods:
            if item["metadata"]["name"] == self.pod and self.claim is None:
                self.claim = dict(claim_names(item)).get(self.entry)
        if self.claim is None:
            return
        obj = self._allocated()
        if obj is None or obj["metadata"].get("resourceVersion") == self._version:
            return
        text = self._describe()
        if text is not None:
            self.text = text
            self._version = obj["metadata"].get("resourceVersion")
            results = ((obj["status"]["allocation"].get("devices") or {}).get("results")) or []
            self.devices = len(results)

    def describe_now(self) -> str | None:
        """The claim described now, or None when it is no longer allocated."""
        if self.claim is None or self._allocated() is None:
            return None
        return self._describe()

    def _allocated(self) -> dict[str, Any] | None:
        from process.kube.errors import ApiError

        path = (
            f"/apis/resource.k8s.io/v1/namespaces/{EXAMPLES_NAMESPACE}/resourceclaims/{self.claim}"
        )
        try:
            obj = self._api.request("GET", path)
        except ApiError:
            return None
        return obj if (obj.get("status") or {}).get("allocation") else None

    def _describe(self) -> str | None:
        done = self._kubectl(
            "describe", "resourceclaim", str(self.claim), "-n", EXAMPLES_NAMESPACE, check=False
        )
        if done.returncode != 0:
            return None
        return str(done.stdout)
