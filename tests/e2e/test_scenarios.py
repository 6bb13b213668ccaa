"""What users do with carve, end to end: ResourceClaim YAML in, a carved slice in the pod.

Every test runs against the real control plane, the real carve-controller process and real
carve-kubelet-plugin processes on simulated GPUs, and ends with every instance destroyed
(checked by the `e2e` fixture's teardown).
"""

from __future__ import annotations

import pytest

from devcluster.waiting import wait_for
from driver import catalog
from driver.naming import parse_device_name
from tests.e2e.harness import E2E, cel, first_available, profile_is, request

pytestmark = pytest.mark.cluster

ATTR = 'device.attributes["mig.carve.dev"]'


def _smallest_profile(key: str) -> str:
    model = catalog.gpu_model(key)
    return min(model.profiles, key=lambda p: (p.size, p.memory_mib, p.id)).name


def test_a_single_slice_on_every_gpu_model_of_the_catalog(e2e: E2E) -> None:
    keys = sorted(catalog.CATALOG)
    half = len(keys) // 2
    nodes = [e2e.node("mixed-a", *keys[:half]), e2e.node("mixed-b", *keys[half:])]
    where = {key: nodes[0] if i < half else nodes[1] for i, key in enumerate(keys)}
    for i, key in enumerate(keys):
        product = catalog.gpu_model(key).product_name
        e2e.template(
            f"m{i}",
            [
                request(
                    "mig",
                    [
                        cel(f'{ATTR}.productName == "{product}"'),
                        cel(f'{ATTR}.profile == "{_smallest_profile(key)}"'),
                    ],
                )
            ],
        )
        e2e.pod(f"p{i}", {"mig": {"resourceClaimTemplateName": f"m{i}"}})
    for i, key in enumerate(keys):
        pod = e2e.wait_phase(f"p{i}", "Running", timeout=90)
        node = where[key]
        assert pod["spec"]["nodeName"] == node.name, key
        [result] = e2e.results(e2e.claim_of(f"p{i}", "mig"))
        device = e2e.published_device(node.name, result["device"])
        assert device["attributes"]["productName"]["string"] == catalog.gpu_model(key).product_name
        assert device["attributes"]["profile"]["string"] == _smallest_profile(key)
    assert sum(len(n.hardware_view().instances) for n in nodes) == len(keys)
    assert e2e.check_invariants() == []


def test_one_claim_with_two_1g_slices_on_the_same_gpu(e2e: E2E) -> None:
    node = e2e.node("a100x2", "A100-SXM4-40GB", "A100-SXM4-40GB")
    # Fill most of GPU 0 first, so "same GPU" is a real constraint and not luck.
    e2e.template("big", [request("mig", [cel(f'{ATTR}.profile == "4g.20gb"')])])
    e2e.pod("filler", {"mig": {"resourceClaimTemplateName": "big"}})
    e2e.wait_phase("filler", "Running")
    e2e.template(
        "pair",
        [request("a", [profile_is("1g.5gb")]), request("b", [profile_is("1g.5gb")])],
        constraints=[{"requests": ["a", "b"], "matchAttribute": "mig.carve.dev/parentUUID"}],
    )
    e2e.pod("p", {"pair": {"resourceClaimTemplateName": "pair"}})
    e2e.wait_phase("p", "Running")
    results = e2e.results(e2e.claim_of("p", "pair"))
    assert sorted(r["request"] for r in results) == ["a", "b"]
    minors = {parse_device_name(r["device"]).minor for r in results}
    assert len(minors) == 1
    parents = {
        e2e.published_device(node.name, r["device"])["attributes"]["parentUUID"]["string"]
        for r in results
    }
    assert len(parents) == 1
    record = node.agent.record_of(e2e.namespace, "p")
    assert record is not None and record.edits is not None
    assert len(record.edits.cdi_ids) == 2
    on_that_gpu = [s for s in node.hardware_view().instances if s.minor in minors]
    assert len(on_that_gpu) >= 2
    assert e2e.check_invariants() == []


def test_a_deployment_scales_up_and_down(e2e: E2E) -> None:
    node = e2e.node("h100", "H100-SXM5-80GB")
    e2e.template("one-1g", [request("mig", [profile_is("1g.10gb")])])
    labels = {"app": "infer"}
    pod = e2e.pod_manifest("unused", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    e2e.apps.create_namespaced_deployment(
        e2e.namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "infer"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {**pod["spec"], "restartPolicy": "Always"},
                },
            },
        },
    )

    def running() -> list[str]:
        pods = e2e.core.list_namespaced_pod(e2e.namespace, label_selector="app=infer").items
        return [
            p.metadata.name
            for p in pods
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]

    wait_for("3 replicas running", lambda: len(running()) == 3, timeout=90)
    assert len(node.hardware_view().instances) == 3
    e2e.apps.patch_namespaced_deployment_scale("infer", e2e.namespace, {"spec": {"replicas": 1}})
    wait_for("scale down to 1", lambda: len(running()) == 1, timeout=60)
    wait_for("2 instances destroyed", lambda: len(node.hardware_view().instances) == 1, 60)
    assert e2e.check_invariants() == []


def test_release_on_completion_and_on_deletion_frees_the_placement(e2e: E2E) -> None:
    node = e2e.node("a30", "A30-24GB")
    e2e.template("whole", [request("mig", [cel(f'{ATTR}.profile == "4g.24gb"')])])

    # Completion: the second pod can only run once the first one's instance is gone.
    e2e.pod("first", {"mig": {"resourceClaimTemplateName": "whole"}}, run_seconds=3)
    e2e.wait_phase("first", "Running")
    [held] = node.hardware_view().instances
    e2e.pod("second", {"mig": {"resourceClaimTemplateName": "whole"}})
    e2e.wait_phase("first", "Succeeded", timeout=30)
    e2e.wait_phase("second", "Running", timeout=60)
    assert node.hardware_view().instances == (held,)  # the same placement, carved again
    first = node.agent.record_of(e2e.namespace, "first")
    second = node.agent.record_of(e2e.namespace, "second")
    assert first is not None and second is not None
    assert first.timings["unprepared"] <= second.timings["prepare_end"]

    # Deletion: the pod object stays until the node has unprepared, then the next one runs.
    e2e.pod("third", {"mig": {"resourceClaimTemplateName": "whole"}})
    e2e.delete_pod("second")
    e2e.wait_gone("second")
    e2e.wait_phase("third", "Running", timeout=60)
    assert node.hardware_view().instances == (held,)
    assert e2e.check_invariants() == []


def test_a_full_node_keeps_the_pod_waiting_with_a_clear_event_while_gpus_are_free(
    e2e: E2E,
) -> None:
    node = e2e.node("small-cpu", "A100-SXM4-40GB", cpu="2", memory="8Gi")
    e2e.template("one-1g", [request("mig", [profile_is("1g.5gb")])])
    e2e.pod("hog", {"mig": {"resourceClaimTemplateName": "one-1g"}}, cpu="1500m")
    e2e.wait_phase("hog", "Running")
    e2e.pod("cpu", {"mig": {"resourceClaimTemplateName": "one-1g"}}, cpu="1")
    e2e.pod("mem", {"mig": {"resourceClaimTemplateName": "one-1g"}}, memory="16Gi")

    def reason(pod: str, needle: str) -> str | None:
        for event in e2e.events("Pod", pod):
            if needle in (event["message"] or ""):
                return str(event["message"])
        return None

    cpu_msg = wait_for("an event about cpu", lambda: reason("cpu", "cpu"), timeout=30)
    wait_for("an event about memory", lambda: reason("mem", "memory"), timeout=30)
    assert node.name in cpu_msg or "node" in cpu_msg
    for name in ("cpu", "mem"):
        pod = e2e.raw_pod(name)
        assert pod is not None
        assert pod["status"].get("phase") == "Pending" and not pod["spec"].get("nodeName")
    assert len(node.hardware_view().instances) == 1  # 6 of 7 1g slots still free

    # Room appears: the cpu-waiting pod runs once the hog is gone.
    e2e.delete_pod("hog")
    e2e.wait_phase("cpu", "Running", timeout=60)


def test_mixed_models_are_chosen_by_product_name_and_by_memory(e2e: E2E) -> None:
    a100 = e2e.node("a100", "A100-SXM4-40GB")
    h100 = e2e.node("h100", "H100-SXM5-80GB", "H100-SXM5-80GB")
    e2e.template("on-h100", [request("mig", [cel(f'{ATTR}.productName.contains("H100")')])])
    e2e.template("on-a100", [request("mig", [cel(f'{ATTR}.productName.contains("A100")')])])
    e2e.template(
        "mem-60gi",
        [
            request(
                "mig",
                [cel('device.capacity["mig.carve.dev"].memory.compareTo(quantity("60Gi")) >= 0')],
            )
        ],
    )
    e2e.pod("h", {"mig": {"resourceClaimTemplateName": "on-h100"}})
    e2e.pod("a", {"mig": {"resourceClaimTemplateName": "on-a100"}})
    assert e2e.wait_phase("h", "Running")["spec"]["nodeName"] == h100.name
    assert e2e.wait_phase("a", "Running")["spec"]["nodeName"] == a100.name
    # Only an H100 slice has 60 GiB (a 7g.80gb), and only the H100 GPU without "h" has room.
    e2e.pod("big", {"mig": {"resourceClaimTemplateName": "mem-60gi"}})
    assert e2e.wait_phase("big", "Running")["spec"]["nodeName"] == h100.name
    [result] = e2e.results(e2e.claim_of("big", "mig"))
    device = e2e.published_device(h100.name, result["device"])
    memory = device["capacity"]["memory"]["value"]
    from driver.quantity import whole_quantity

    assert whole_quantity(memory) >= 60 * 2**30
    assert e2e.check_invariants() == []


def test_first_available_falls_back_to_a_smaller_profile(e2e: E2E) -> None:
    node = e2e.node("a30", "A30-24GB")
    e2e.template("half", [request("mig", [cel(f'{ATTR}.profile == "2g.12gb"')])])
    e2e.pod("half", {"mig": {"resourceClaimTemplateName": "half"}})
    e2e.wait_phase("half", "Running")
    e2e.template(
        "flexible",
        [
            first_available(
                "mig",
                [
                    ("big", [cel(f'{ATTR}.profile == "4g.24gb"')]),
                    ("small", [cel(f'{ATTR}.profile.startsWith("2g.")')]),
                ],
            )
        ],
    )
    e2e.pod("flex", {"mig": {"resourceClaimTemplateName": "flexible"}})
    e2e.wait_phase("flex", "Running")
    [result] = e2e.results(e2e.claim_of("flex", "mig"))
    assert result["request"] == "mig/small"
    assert "-mig-2g12gb-" in result["device"]
    assert len(node.hardware_view().instances) == 2
    assert e2e.check_invariants() == []


def test_a_prepare_that_keeps_failing_fails_the_pod_with_the_plugins_message(e2e: E2E) -> None:
    from driver.nvml import sim

    node = e2e.node("faulty", "A100-SXM4-40GB")
    sim.configure(node.sim_config)
    try:
        # Faults live in the node's simulator state, so they reach the plugin process.
        sim.sim_inject_fault("CreateGpuInstanceWithPlacement", error="UNKNOWN", times=50)
    finally:
        sim.configure(None)
    e2e.template("one-1g", [request("mig", [profile_is("1g.5gb")])])
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    pod = e2e.wait_phase("p", "Failed", timeout=90)
    assert pod["status"]["reason"] == "FailedPrepareDynamicResources"
    message = pod["status"]["message"]
    assert "claim p-mig-" in message  # which claim
    assert "cannot create 1g.5gb" in message and "NVML error 999" in message  # what failed
    reasons = [e["reason"] for e in e2e.events("Pod", "p")]
    assert reasons.count("FailedPrepareDynamicResources") >= 2  # retried before giving up
    assert node.hardware_view().instances == ()
    sim.configure(node.sim_config)
    try:
        sim.sim_clear_faults()
    finally:
        sim.configure(None)
