"""A pod that asks `resources.limits: {nvidia.com/mig-3g.40gb: 1}` (no claim) runs on a slice
that the real plugin carves on a simulated node, where carve's best fit put it, and the slice
is destroyed and released when the pod ends (docs/extended-resources.md)."""

from __future__ import annotations

import pytest

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from nodesim.simnode import SimNode, read_hardware
from tests.e2e.harness import E2E, GROUP_LABEL, profile_is, request

pytestmark = pytest.mark.cluster


def limits_pod(e2e: E2E, name: str, limits: dict[str, str], run_seconds: float) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": {"nodesim.carve.dev/run-seconds": str(run_seconds)},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {GROUP_LABEL: e2e.group},
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example/cuda:12",
                    "resources": {"limits": dict(limits)},
                }
            ],
        },
    }


def _extended_claim(e2e: E2E, pod_name: str) -> Obj | None:
    pod = e2e.raw_pod(pod_name) or {}
    name = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get(
        "resourceClaimName"
    )
    return next((c for c in e2e.claims() if c["metadata"]["name"] == name), None)


def test_a_limits_pod_runs_on_a_carved_slice_placed_by_best_fit_and_releases_it(
    e2e: E2E,
) -> None:
    nodes = {n.name: n for n in (e2e.node("a", "H100-SXM5-80GB"), e2e.node("b", "H100-SXM5-80GB"))}
    # The existing workload: a 3g.40gb claim pod, wherever carve puts it.
    e2e.template("three", [request("mig", [profile_is("3g.40gb")])])
    e2e.pod("holder", {"mig": {"resourceClaimTemplateName": "three"}})
    busy = nodes.pop(e2e.wait_phase("holder", "Running")["spec"]["nodeName"])
    (empty,) = nodes.values()
    assert len(busy.hardware_view().instances) == 1

    e2e.core.create_namespaced_pod(
        e2e.namespace, limits_pod(e2e, "limits", {"nvidia.com/mig-3g.40gb": "1"}, run_seconds=4)
    )
    pod = e2e.wait_phase("limits", "Running")
    # carve's best fit packs it next to the holder; the empty GPU stays whole.
    assert pod["spec"]["nodeName"] == busy.name, e2e.diagnostics("limits")
    assert not empty.hardware_view().instances
    claim = _extended_claim(e2e, "limits")
    assert claim is not None
    [result] = e2e.results(claim)
    carved = {f"-{i.profile_id}-{i.start}" for i in busy.hardware_view().instances}
    assert len(carved) == 2
    assert any(result["device"].endswith(s) for s in carved), (result, carved)
    assert "-mig-3g40gb-" in result["device"]
    placed = wait_for(  # events are written beside the decision thread: the pod may run first
        "carve's Placed event on limits",
        lambda: [e for e in e2e.events("Pod", "limits") if e.get("reason") == "Placed"],
        timeout=30,
    )
    assert placed and busy.name in placed[0]["message"]
    assert e2e.check_invariants() == []

    e2e.wait_phase("limits", "Succeeded", timeout=30)
    wait_for(
        "the slice to be destroyed",
        lambda: len(busy.hardware_view().instances) == 1,
        timeout=30,
    )

    def released() -> bool:
        gone = next(
            (c for c in e2e.claims() if c["metadata"]["uid"] == claim["metadata"]["uid"]), None
        )
        return gone is None or not (gone.get("status") or {}).get("allocation")

    wait_for("its claim to be released", released, timeout=60)


def _mig_modes(node: SimNode) -> list[int]:
    return [int(g["mig_current"]) for g in read_hardware(node.sim_config)["gpus"]]


def _event(e2e: E2E, pod: str, needle: str) -> str | None:
    return next(
        (str(e["message"]) for e in e2e.events("Pod", pod) if needle in (e["message"] or "")),
        None,
    )


def test_nvidia_gpu_1_gets_a_whole_gpu_with_mig_mode_off_never_a_slice(e2e: E2E) -> None:
    """The chart maps nvidia.com/gpu to carve's whole-GPU class by default, as NVIDIA's chart
    maps it to gpu.nvidia.com (issue 31.5). An A100 in MIG mode is never offered whole (only
    a GPU reset changes its MIG mode), so the pod waits and says why; an H100 in MIG mode is:
    the plugin turns MIG mode off for the pod and back on after it."""
    a100 = e2e.node("a100", "A100-SXM4-40GB")
    e2e.core.create_namespaced_pod(
        e2e.namespace, limits_pod(e2e, "legacy", {"nvidia.com/gpu": "1"}, run_seconds=6)
    )
    message = wait_for(
        "an event saying why no GPU is offered whole",
        lambda: _event(e2e, "legacy", "in MIG mode offer no whole GPU"),
        timeout=30,
    )
    assert message.startswith("nvidia.com/gpu of container main:"), message
    assert "-mig 0" in message  # what an operator can do about it
    pod = e2e.raw_pod("legacy")
    assert pod is not None and not pod["spec"].get("nodeName")
    assert not a100.hardware_view().instances and _mig_modes(a100) == [1]

    # The H100 starts in MIG mode (as every simulated GPU does) and is offered whole at once;
    # its mode is not read here: the waiting pod may already be placed there and have turned
    # it off. It is back on after the pod (below).
    h100 = e2e.node("h100", "H100-SXM5-80GB")
    running = e2e.wait_phase("legacy", "Running", timeout=60)
    assert running["spec"]["nodeName"] == h100.name, e2e.diagnostics("legacy")
    claim = _extended_claim(e2e, "legacy")
    assert claim is not None
    assert [r["device"] for r in e2e.results(claim)] == ["gpu-0"]  # the GPU, not a slice
    assert _mig_modes(h100) == [0] and not h100.hardware_view().instances
    uuid = str(read_hardware(h100.sim_config)["gpus"][0]["uuid"])
    assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in e2e.container_env("legacy")

    e2e.wait_phase("legacy", "Succeeded", timeout=30)
    wait_for("MIG mode back on", lambda: _mig_modes(h100) == [1], timeout=30)
    assert _mig_modes(a100) == [1]
    assert e2e.check_invariants() == []
