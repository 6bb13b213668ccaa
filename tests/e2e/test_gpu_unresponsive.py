"""One GPU whose NVML calls hang, through the real controller and a real plugin process
(issue 45, item 1).

Before, a hung call on one GPU blocked housekeeping and, once the kubelet's retries filled the
prepare workers, every prepare on the node; nothing told the user. Now the GPU is
*unresponsive*: a Node event names it and the call, its devices are tainted (`carve status`
shows it), `/readyz` stays ready with a report line, the node's other GPU keeps preparing, and
when the call returns the GPU comes back with nothing leaked.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TypeVar

import pytest

from carvecli.main import main as carve_cli
from devcluster.waiting import wait_for
from driver.nvml import sim
from nodesim.gpufault import WATCHED_CALL
from nodesim.simnode import SimNode
from tests.e2e.harness import E2E, profile_is, request
from tests.support.ops_probe import readyz
from tests.support.plugin_process import free_port

pytestmark = pytest.mark.cluster

TAINT = "mig.carve.dev/gpu-unresponsive"
T = TypeVar("T")


def _status(e2e: E2E) -> str:
    out = io.StringIO()
    assert carve_cli(["status", "--kubeconfig", str(e2e.stack.kubeconfig)], out) == 0
    return out.getvalue()


def _described(e2e: E2E, node: SimNode) -> str:
    return str(e2e.stack.kubectl("describe", "node", node.name, check=False).stdout)


def _on_sim(node: SimNode, fn: Callable[[], T]) -> T:
    """`fn` against the node's simulated NVML (its state file, shared with its plugin)."""
    sim.configure(node.sim_config)
    try:
        return fn()
    finally:
        sim.configure(None)


def test_a_hung_gpu_is_told_tainted_and_the_other_gpu_keeps_preparing(e2e: E2E) -> None:
    port = free_port()
    node = e2e.node(
        "hung",
        "H100-SXM5-80GB",
        "A100-SXM4-40GB",
        plugin_args=(f"--http-address=127.0.0.1:{port}", "--nvml-timeout=2s"),
    )
    e2e.template("h100-slice", [request("mig", [profile_is("1g.10gb")])])
    e2e.template("a100-slice", [request("mig", [profile_is("1g.5gb")])])
    e2e.pod("on-h100", {"mig": {"resourceClaimTemplateName": "h100-slice"}})
    e2e.wait_phase("on-h100", "Running")

    _on_sim(node, lambda: sim.sim_inject_fault(WATCHED_CALL, hang=True, gpu=0))
    try:
        wait_for(
            "the GpuUnresponsive event in kubectl describe node",
            lambda: _described(e2e, node),
            until=lambda d: "GpuUnresponsive" in d and "GPU index 0" in d,
            timeout=60,
        )
        wait_for(
            "the unresponsive taint in carve status",
            lambda: _status(e2e),
            until=lambda out: TAINT in out,
            timeout=60,
        )
        # Ready means "this agent serves": the A100 is served, the H100 is a report line.
        _, ready_text = wait_for(
            "/readyz ready and naming GPU 0",
            lambda: r if (r := readyz(port))[0] == 200 and "GPU index 0" in r[1] else None,
        )
        assert "[!]gpus" in ready_text and "unresponsive" in ready_text, ready_text
        assert "[-]" not in ready_text, ready_text

        # The healthy GPU prepares while the H100's call still hangs.
        e2e.pod("on-a100", {"mig": {"resourceClaimTemplateName": "a100-slice"}})
        e2e.wait_phase("on-a100", "Running")
        assert _on_sim(node, sim.sim_hung_calls), "the hang was released too early"

        # Released on the hung GPU: kept (finalizer and record) until the GPU answers.
        e2e.delete_pod("on-h100")
    finally:
        _on_sim(node, lambda: sim.sim_release_hangs(gpu=0))
    wait_for(
        "the GpuBack event",
        lambda: _described(e2e, node),
        until=lambda d: "GpuBack" in d,
        timeout=60,
    )
    e2e.wait_gone("on-h100", timeout=90)
    wait_for("the H100's slice destroyed", lambda: not _instances_on(node, 0), timeout=60)
    wait_for("the taint gone", lambda: _status(e2e), until=lambda out: TAINT not in out)


def _instances_on(node: SimNode, minor: int) -> list[object]:
    hw = node.hardware_view()
    return [s for s in hw.claimed if s.minor == minor]
