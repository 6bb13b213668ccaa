"""A sick GPU on the real control plane (issue 11, point 2): XIDs injected into a node's
simulated NVML become device taints in its ResourceSlices; kube-controller-manager's
device-taint eviction evicts the pods on a NoExecute GPU, carve's controller places new pods
elsewhere, and the taint is gone after the GPU is reset. A degraded GPU gets NoSchedule only.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from devcluster.waiting import wait_for
from driver.nvml import sim
from nodesim.simnode import SimNode
from tests.e2e.harness import E2E, profile_is, request

pytestmark = pytest.mark.cluster

KEY = "mig.carve.dev/gpu-unhealthy"


def _taints(e2e: E2E, node: SimNode) -> dict[str, set[tuple[str, str]]]:
    """Device name -> its (value, effect) taints, for the tainted devices of the node."""
    resp = e2e.resource.list_resource_slice(
        field_selector=f"spec.nodeName={node.name}", _preload_content=False
    )
    out: dict[str, set[tuple[str, str]]] = {}
    for s in json.loads(resp.data)["items"]:
        for d in s["spec"].get("devices") or []:
            taints = {(t.get("value", ""), t["effect"]) for t in d.get("taints") or []}
            if taints:
                out[d["name"]] = taints
    return out


def _on_gpu(e2e: E2E, pod: str) -> int:
    (result,) = e2e.results(e2e.claim_of(pod, "mig"))
    return int(result["device"].split("-")[1])


def _sim(node: SimNode) -> Any:
    sim.configure(node.sim_config)
    return sim


def test_a_fatal_xid_evicts_and_taints_until_reset_and_a_degraded_one_only_blocks(
    e2e: E2E,
) -> None:
    node = e2e.node("sick", *["H100-SXM5-80GB"] * 3)
    e2e.template("one-1g", [request("mig", [profile_is("1g.10gb")])])
    for name in ("a", "b"):
        e2e.pod(name, {"mig": {"resourceClaimTemplateName": "one-1g"}})
        e2e.wait_phase(name, "Running")
    gpu = _on_gpu(e2e, "a")
    assert _on_gpu(e2e, "b") == gpu  # best fit packs them onto one GPU
    assert _taints(e2e, node) == {}
    try:
        _sim(node).sim_inject_xid(gpu, 79)  # the GPU has fallen off the bus
    finally:
        sim.configure(None)

    tainted = wait_for(
        "the GPU's devices tainted NoExecute",
        lambda: _taints(e2e, node) or None,
        timeout=30,
    )
    assert all(n.startswith(f"gpu-{gpu}") for n in tainted), tainted
    assert set().union(*tainted.values()) == {("xid-79", "NoExecute")}
    wait_for(
        "device-taint eviction of both pods",
        lambda: e2e.raw_pod("a") is None and e2e.raw_pod("b") is None,
        timeout=60,
    )
    e2e.pod("c", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    e2e.wait_phase("c", "Running")
    # New pods avoid the sick GPU. Every GPU is empty again, as when pod a went to `gpu`, and
    # the engine is deterministic: without the taint it would choose `gpu` again.
    assert _on_gpu(e2e, "c") != gpu

    degraded = _on_gpu(e2e, "c")
    try:
        _sim(node).sim_inject_xid(degraded, 92)  # high single-bit ECC rate: degraded only
    finally:
        sim.configure(None)
    wait_for(
        "the degraded GPU tainted NoSchedule",
        lambda: any(n.startswith(f"gpu-{degraded}") for n in _taints(e2e, node)),
        timeout=30,
    )
    effects = {
        eff
        for n, taints in _taints(e2e, node).items()
        if n.startswith(f"gpu-{degraded}")
        for _, eff in taints
    }
    assert effects == {"NoSchedule"}
    # A plugin crash forgets nothing: the XID 92 event was read once, and only the saved
    # condition still knows of it. The restarted plugin republishes the taint at once.
    node.kill_plugin()
    node.start_plugin()
    node.wait_plugin_ready()
    assert "GPU health restored from the last run" in wait_for(
        "the restarted plugin's log", lambda: _restored(node), timeout=30
    )
    assert any(n.startswith(f"gpu-{degraded}") for n in _taints(e2e, node))
    e2e.pod("d", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    e2e.wait_phase("d", "Running")
    assert _on_gpu(e2e, "d") not in (gpu, degraded)  # neither sick GPU takes new work
    time.sleep(5)  # NoSchedule does not evict: c keeps running on the degraded GPU
    pod = e2e.raw_pod("c")
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert not pod["metadata"].get("deletionTimestamp")

    try:
        _sim(node).sim_reset_gpu(gpu)  # the operator resets the GPU
    finally:
        sim.configure(None)
    wait_for(
        "the reset GPU's taint to go",
        lambda: not any(n.startswith(f"gpu-{gpu}") for n in _taints(e2e, node)),
        timeout=30,
    )
    # What an operator reads: `kubectl describe node` lists the plugin's events.
    told = wait_for("the node's GPU health events", lambda: _described(e2e, node), timeout=30)
    assert "GpuUnhealthy" in told and "XID 79 (GPU has fallen off the bus)" in told, told
    assert "XID 92" in told
    assert e2e.check_invariants() == []


def _described(e2e: E2E, node: SimNode) -> str | None:
    out = e2e.stack.kubectl("describe", "node", node.name, check=False).stdout
    return out if "GpuHealthy" in out else None


def _restored(node: SimNode) -> str | None:
    text = node.plugin_log.read_text(errors="replace")
    return text if "GPU health restored from the last run" in text else None
