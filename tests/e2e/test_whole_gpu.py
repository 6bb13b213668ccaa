"""Whole-GPU claims get a GPU out of MIG mode (issue 11, point 4), on the real control plane
with the real carve-controller and carve-kubelet-plugin processes on simulated GPUs.

H100: the plugin turns MIG mode off when it prepares the claim and on again once the pod is
gone; meanwhile the node publishes no MIG slice of that GPU and a MIG pod waits for it. A100:
MIG mode changes only with a GPU reset, so only a GPU whose MIG mode was off is offered whole;
with none, the pod waits with an Event that says why and what to run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.config import API_VERSION, KIND_MIG_DEVICE_CONFIG
from driver.nvml.sim.mpscontrol import CONTROL_LOG
from nodesim.simnode import SimNode, read_hardware
from tests.e2e.harness import E2E, cel, profile_is, request

pytestmark = pytest.mark.cluster

ATTR = 'device.attributes["mig.carve.dev"]'


def _mig_modes(node: SimNode) -> list[int]:
    """Per GPU (config order) the current MIG mode as the simulated hardware has it."""
    return [int(g["mig_current"]) for g in read_hardware(node.sim_config)["gpus"]]


def _published(e2e: E2E, node: SimNode) -> set[str]:
    resp = e2e.resource.list_resource_slice(
        field_selector=f"spec.nodeName={node.name}", _preload_content=False
    )
    return {
        d["name"] for s in json.loads(resp.data)["items"] for d in s["spec"].get("devices") or []
    }


def _devices(e2e: E2E, pod: str, entry: str) -> list[str]:
    return [r["device"] for r in e2e.results(e2e.claim_of(pod, entry))]


def _event(e2e: E2E, pod: str, needle: str) -> str | None:
    for event in e2e.events("Pod", pod):
        if needle in (event["message"] or ""):
            return str(event["message"])
    return None


def _mps(driver: str, **settings: object) -> Obj:
    """Claim config: MPS sharing with these mpsConfig settings."""
    return {
        "opaque": {
            "driver": driver,
            "parameters": {
                "apiVersion": API_VERSION,
                "kind": KIND_MIG_DEVICE_CONFIG,
                "sharing": {"strategy": "MPS", "mpsConfig": settings},
            },
        }
    }


def test_a_whole_h100_has_mig_mode_off_and_gets_it_back_after_the_pod(
    e2e: E2E, tmp_path: Path
) -> None:
    """The whole GPU is shared through MPS, as NVIDIA's gpu-test-mps examples share one (issue
    31, point 4): its daemon serves the GPU by UUID while MIG mode is off, and is gone before
    MIG mode is back on."""
    # A driver root the simulator fills, with the nvidia-cuda-mps-control stand-in.
    node = e2e.node("h100", "H100-SXM5-80GB", plugin_args=(f"--driver-root={tmp_path}",))
    gpu_class = e2e.stack.contract.gpu_class
    e2e.template(
        "whole",
        [request("gpu", device_class=gpu_class)],
        config=[_mps(node.driver, defaultActiveThreadPercentage=50)],
    )
    e2e.template("one-1g", [request("mig", [profile_is("1g.")])])
    assert _mig_modes(node) == [1]
    e2e.pod("whole", {"gpu": {"resourceClaimTemplateName": "whole"}})
    e2e.wait_phase("whole", "Running")
    assert _devices(e2e, "whole", "gpu") == ["gpu-0"]
    assert _mig_modes(node) == [0]  # the container got a GPU CUDA can use whole
    uuid = str(read_hardware(node.sim_config)["gpus"][0]["uuid"])
    env = e2e.container_env("whole")
    assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in env
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env, env
    claim_uid = e2e.claim_of("whole", "gpu")["metadata"]["uid"]
    daemon = node.plugins_dir / node.driver / "mps" / claim_uid
    log = (daemon / "log" / CONTROL_LOG).read_text()
    assert f"CUDA_VISIBLE_DEVICES={uuid}" in log and "percentage 50" in log, log
    wait_for(
        "the node to withdraw gpu-0's MIG devices",
        lambda: _published(e2e, node) == {"gpu-0"},
        timeout=30,
    )
    # A MIG pod waits: the controller's model and the slices agree that nothing is free.
    e2e.pod("slice", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    message = wait_for(
        "an event on the waiting MIG pod",
        lambda: (
            _event(e2e, "slice", "allocated whole offer no MIG slice")
            or _event(e2e, "slice", "no free placement")
        ),
        timeout=30,
    )
    assert node.hardware_view().instances == (), message
    pod = e2e.raw_pod("slice")
    assert pod is not None and not pod["spec"].get("nodeName")

    e2e.delete_pod("whole")
    e2e.wait_gone("whole")
    wait_for("MIG mode back on", lambda: _mig_modes(node) == [1], timeout=30)
    assert not daemon.exists()  # the daemon was stopped (and its directories went) first
    e2e.wait_phase("slice", "Running", timeout=60)  # MIG devices are back, and usable
    assert _devices(e2e, "slice", "mig")[0].startswith("gpu-0-mig-1g")
    assert len(node.hardware_view().instances) == 1
    assert e2e.check_invariants() == []


def test_a_whole_a100_is_only_one_whose_mig_mode_was_off(e2e: E2E) -> None:
    gpu_class = e2e.stack.contract.gpu_class
    e2e.template(
        "whole-a100",
        [request("gpu", [cel(f'{ATTR}.productName.contains("A100")')], device_class=gpu_class)],
    )
    in_mig_mode = e2e.node("a100-mig", "A100-SXM4-40GB", "A100-SXM4-40GB")
    e2e.wait_slices_published(in_mig_mode.name)  # CI read them once before the first sync
    assert _published(e2e, in_mig_mode) and not {"gpu-0", "gpu-1"} & _published(e2e, in_mig_mode)
    e2e.pod("whole", {"gpu": {"resourceClaimTemplateName": "whole-a100"}})
    message = wait_for(
        "an event saying why no A100 is offered whole",
        lambda: _event(e2e, "whole", "in MIG mode offer no whole GPU"),
        timeout=30,
    )
    assert "only a GPU reset turns MIG mode off" in message and "-mig 0" in message
    pod = e2e.raw_pod("whole")
    assert pod is not None and not pod["spec"].get("nodeName")

    # An operator took GPU 1 of a second node out of MIG mode: the pod goes there, GPU 1 only.
    mixed = e2e.node("a100-mixed", "A100-SXM4-40GB", "A100-SXM4-40GB", mig_off=(1,))
    assert "gpu-1" in _published(e2e, mixed) and "gpu-0" not in _published(e2e, mixed)
    e2e.wait_phase("whole", "Running", timeout=60)
    claim = e2e.claim_of("whole", "gpu")
    (result,) = e2e.results(claim)
    assert (result["pool"], result["device"]) == (mixed.name, "gpu-1")
    assert _mig_modes(mixed) == [1, 0] and _mig_modes(in_mig_mode) == [1, 1]  # nothing toggled
    e2e.delete_pod("whole")
    e2e.wait_gone("whole")
    assert _mig_modes(mixed) == [1, 0]
    assert e2e.check_invariants() == []


def test_a_whole_gpu_claim_gets_its_cdi_spec_back_after_a_reboot(e2e: E2E) -> None:
    """Issue 32, point 4: /var/run/cdi is a tmpfs. After a reboot the claim's record survives
    (a whole GPU has no instance to lose) but its spec is gone; the restarted plugin writes it
    again, so the IDs the kubelet holds name a spec that exists when it starts the containers
    again (before, CreateContainerError until someone deleted the pod)."""
    from driver import cdi
    from driver.nvml import sim

    node = e2e.node("boot", "H100-SXM5-80GB")
    e2e.template("whole", [request("gpu", device_class=e2e.stack.contract.gpu_class)])
    e2e.pod("whole", {"gpu": {"resourceClaimTemplateName": "whole"}})
    e2e.wait_phase("whole", "Running")
    uid = e2e.claim_of("whole", "gpu")["metadata"]["uid"]
    spec = node.cdi_dir / f"{node.driver}-claim_{uid}.json"
    ids = (f"{node.driver}/claim={uid}-gpu-0",)
    assert cdi.resolve([node.cdi_dir], ids).device_nodes
    node.kill_plugin()
    sim.configure(node.sim_config)
    try:
        sim.sim_reboot()
    finally:
        sim.configure(None)
    spec.unlink()  # the tmpfs comes back empty
    node.start_plugin()
    node.wait_plugin_ready()
    wait_for("the spec written again", spec.exists, timeout=30)
    assert cdi.resolve([node.cdi_dir], ids).device_nodes  # the kubelet's IDs resolve again
    e2e.delete_pod("whole")
    e2e.wait_gone("whole")
