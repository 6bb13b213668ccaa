"""A pod with a carve claim runs on a simulated GPU node: allocation (controller or
kube-scheduler), prepare through the real plugin, CDI spec on disk, release at the end."""

from __future__ import annotations

import pytest

from devcluster.waiting import wait_for
from tests.e2e.harness import E2E, NATIVE_CLASS, profile_is, request

pytestmark = pytest.mark.cluster


def test_native_path_kube_scheduler_allocates_and_the_node_prepares(e2e: E2E) -> None:
    node = e2e.node("a100", "A100-SXM4-40GB")
    e2e.template(
        "one-1g", [request("mig", [profile_is("1g.")], device_class=NATIVE_CLASS)], gated=False
    )
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "one-1g"}}, run_seconds=2)

    pod = e2e.wait_phase("p", "Running")
    assert pod["spec"]["nodeName"] == node.name
    assert not pod["spec"].get("schedulingGates")  # not carve's class: never gated
    claim = e2e.claim_of("p", "mig")
    [result] = e2e.results(claim)
    assert result["device"].startswith("gpu-0-mig-1g5gb-")
    [instance] = node.hardware_view().instances
    assert f"-{instance.profile_id}-{instance.start}" in result["device"]
    record = node.agent.record_of(e2e.namespace, "p")
    assert record is not None and record.edits is not None
    assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=MIG-") for e in record.edits.env)

    e2e.wait_phase("p", "Succeeded", timeout=30)
    wait_for("the instance to be destroyed", lambda: not node.hardware_view().instances, 20)


def test_controller_places_a_gated_pod_and_describe_shows_the_result(e2e: E2E) -> None:
    node = e2e.node("h100", "H100-SXM5-80GB")
    e2e.template("one-1g", [request("mig", [profile_is("1g.")])])
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "one-1g"}})

    pod = e2e.wait_phase("p", "Running")
    assert pod["spec"]["nodeName"] == node.name
    claim = e2e.claim_of("p", "mig")
    assert "mig.carve.dev/placement" not in str(pod["spec"].get("schedulingGates"))
    [result] = e2e.results(claim)
    assert result["pool"] == node.name
    assert result["device"].startswith("gpu-0-mig-1g")
    # The allocation names exactly the placement the node carved.
    [instance] = node.hardware_view().instances
    assert result["device"].endswith(f"-{instance.profile_id}-{instance.start}")

    text = e2e.describe(claim["metadata"]["name"], "resourceclaim")
    assert result["device"] in text
    assert node.name in text  # the allocation's node selector
    assert "Reserved For" in text and "p" in text
    assert e2e.check_invariants() == []


def test_carve_status_draws_the_carved_slices_from_the_api(e2e: E2E) -> None:
    import subprocess
    import sys
    from pathlib import Path

    node = e2e.node("a100", "A100-SXM4-40GB")
    e2e.template("three", [request("mig", [profile_is("3g.")])])
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "three"}})
    e2e.wait_phase("p", "Running")
    claim = e2e.claim_of("p", "mig")
    carve = Path(sys.executable).with_name("carve")
    done = subprocess.run(
        [str(carve), "status", f"--kubeconfig={e2e.stack.kubeconfig}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    out = done.stdout
    assert f"node {node.name}" in out
    section = out.split(f"node {node.name}")[1].split("\nnode ")[0]
    assert "AAAA" in section  # a 3g.20gb holds four of the eight memory slices
    assert f"claim {e2e.namespace}/{claim['metadata']['name']}" in section
    assert "(for p)" in section
