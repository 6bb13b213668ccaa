"""Issue 45, points 1 and 2: a hung NVML call, or any NVML error, stays on its GPU.

A node with an H100 (GPU 0) and an A100 (GPU 1) on the simulator, whose "hang" fault holds an
NVML call until released, with a short deadline. On main before this change a carve hanging on
the H100 held its GPU lock and its prepare worker for as long as the call hung, so housekeeping
and the kubelet's retries blocked behind it; now the carve fails after the deadline with the
call named, later claims on the H100 fail at once, the A100 keeps preparing and releasing, and
once the call returns nothing is left behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.waiting import wait_for
from driver.nvml import sim
from kubeletplugin.checkpoint import WarmState
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, started_node

A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
FINALIZER = f"{DRIVER}/node-{NODE}"
DEADLINE = 0.3


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with started_node(tmp_path, [H100, A100], nvml_timeout=DEADLINE) as n:
        yield n
        sim.sim_release_hangs()


def test_a_hung_carve_fails_after_the_deadline_and_the_other_gpu_keeps_working(
    node: Node,
) -> None:
    n = node
    sim.sim_inject_fault("DeviceCreateGpuInstanceWithPlacement", hang=True, gpu=0)
    stuck = n.claims.add("stuck", [mig(n.backend, 0, 19, 0)])
    started = time.monotonic()
    result = n.p.prepare([stuck])[stuck.uid]
    assert time.monotonic() - started < DEADLINE + 2  # not for as long as the call hangs
    assert result.reason == "gpu-unresponsive", result
    assert "is unresponsive: the NVML call to create a MIG instance has not returned" in (
        result.error
    )

    # The kubelet's retry gets the same answer at once, without a worker blocked on it.
    started = time.monotonic()
    again = n.p.prepare([stuck])[stuck.uid]
    assert again.reason in ("gpu-unresponsive", "destroy-failed"), again
    assert "unresponsive" in again.error and time.monotonic() - started < DEADLINE
    fresh = n.claims.add("fresh", [mig(n.backend, 0, 19, 1)])
    refused = n.p.prepare([fresh])[fresh.uid]
    assert refused.reason == "gpu-unresponsive" and refused.error, refused
    assert fresh.uid not in n.p.checkpoint().claims and n.claims.finalizers(fresh) == []

    # The A100 prepares and releases throughout, and housekeeping does not wait on the H100.
    for i in range(3):
        ok = n.claims.add(f"ok-{i}", [mig(n.backend, 1, 19, i)])
        assert n.p.prepare([ok])[ok.uid].error == ""
        assert n.p.unprepare([ok]) == {ok.uid: ""}
    started = time.monotonic()
    n.p.retry_pending()
    assert time.monotonic() - started < DEADLINE
    assert stuck.uid in n.p.checkpoint().claims  # kept until the GPU says what happened

    # The call returns: the carve it was holding happens, and housekeeping undoes it.
    assert sim.sim_release_hangs() == 1
    wait_for("the hung carve to return", lambda: n.backend.hung() == {}, timeout=10, interval=0.01)
    assert [i[:3] for i in n.instances()] == [(0, 19, 0)]  # the late instance
    n.p.retry_pending()
    assert n.instances() == []
    assert n.p.checkpoint().claims == {} and n.claims.finalizers(stuck) == []
    assert n.p.checkpoint().foreign == ()  # never mistaken for someone else's
    retry = n.p.prepare([stuck])[stuck.uid]  # the kubelet's next retry carves normally
    assert retry.error == "" and [i[:3] for i in n.instances()] == [(0, 19, 0)]


def test_a_hung_destroy_keeps_the_claim_until_the_call_returns(node: Node) -> None:
    n = node
    ref = n.claims.add("c", [mig(n.backend, 0, 19, 0)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    sim.sim_inject_fault("GpuInstanceDestroy", hang=True, gpu=0)
    err = n.p.unprepare([ref])[ref.uid]
    assert "unresponsive" in err and "destroy a MIG instance" in err
    assert ref.uid in n.p.checkpoint().claims and n.claims.finalizers(ref) == [FINALIZER]
    sim.sim_release_hangs()
    wait_for(
        "the hung destroy to return", lambda: n.backend.hung() == {}, timeout=10, interval=0.01
    )
    assert n.p.unprepare([ref]) == {ref.uid: ""}
    assert n.instances() == [] and n.p.checkpoint().claims == {}
    assert n.claims.finalizers(ref) == []


def test_a_claim_released_while_its_gpu_answered_lost_leaves_no_instance(node: Node) -> None:
    """On main the claim was forgotten and its instance kept for good once the GPU answered
    again (then recorded as foreign: tainted, never destroyed)."""
    n = node
    ref = n.claims.add("c", [mig(n.backend, 1, 19, 2)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    sim.sim_inject_fault("DeviceGetGpuInstanceById", error="GPU_IS_LOST", gpu=1, times=1)
    assert n.p.unprepare([ref]) == {ref.uid: ""}  # released: its GPU is lost
    assert n.p.checkpoint().claims == {} and n.claims.finalizers(ref) == []
    (owed,) = n.p.checkpoint().warm
    assert owed.state is WarmState.RECLAIMING and (owed.gpu_minor, owed.placement_start) == (1, 2)
    n.p.retry_pending()  # the GPU answers again, with the instance
    assert n.instances() == [] and n.p.checkpoint().warm == ()
    assert n.p.checkpoint().foreign == ()
