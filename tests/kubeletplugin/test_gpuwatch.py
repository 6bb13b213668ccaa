"""GpuWatch: every way a GPU becomes unusable is told once and tainted by kind, and a GPU that
answers again is handed back (issue 45, points 1 and 2).

Before, a GPU that started failing after the plugin had published it stayed published with no
taint (the backend lists a GPU it read before with what it read), while the GpuFailing event
said it was withdrawn: carve's controller kept placing claims there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml import sim
from kubeletplugin.checkpoint import Checkpoint, ClaimRecord, ClaimState, DeviceRecord
from kubeletplugin.gpuwatch import GpuWatch
from kubeletplugin.metrics import PluginMetrics
from tests.kubeletplugin.node_harness import Node, mig, open_node

KEY = "mig.carve.dev/gpu-unresponsive"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, ["H100-SXM5-80GB", "A100-SXM4-40GB"], nvml_timeout=0.3)
    yield n
    sim.sim_clear_faults()
    n.backend.close()
    sim.configure(None)


def _watch(n: Node, backs: list[str], changes: list[str]) -> GpuWatch:
    return GpuWatch(
        n.backend,
        n,
        PluginMetrics(),
        taint_key=KEY,
        on_back=lambda: backs.append("back"),
        on_change=lambda: changes.append("changed"),
    )


def test_a_gpu_that_fails_after_it_was_published_is_tainted_then_given_back(node: Node) -> None:
    backs: list[str] = []
    changes: list[str] = []
    watch = _watch(node, backs, changes)
    h100, a100 = node.backend.gpus()
    watch.check()
    assert watch.taints() == {} and changes == []

    sim.sim_inject_fault("DeviceGetUUID", error="UNKNOWN", gpu=1, times=1_000_000)
    watch.check()
    watch.check()  # told once, not at every look
    assert [(t, r) for t, r, _ in node.node_events] == [("Warning", "GpuFailing")]
    assert (
        "tainted mig.carve.dev/gpu-unresponsive=nvml-error:NoSchedule" in (node.node_events[0][2])
    )
    assert watch.taints() == {
        a100.uuid: ({"key": KEY, "value": "nvml-error", "effect": "NoSchedule"},)
    }
    assert changes == ["changed"]
    assert "GPU index 1 is failing" in watch.summary()

    # A claim whose unprepare is unfinished there gets NoExecute on its device.
    device = DeviceRecord(
        mig(node.backend, 1, 19, 2), ("req0",), "node-x", a100.uuid, 1, 19, 2, 1, 3, 0
    )
    record = ClaimRecord("u1", "default", "c", ClaimState.UNPREPARE_STARTED, (device,), True)
    stuck = watch.stuck_device_taints(Checkpoint(claims={"u1": record}))
    assert stuck == {
        a100.uuid: {(19, 2): ({"key": KEY, "value": "nvml-error", "effect": "NoExecute"},)}
    }

    sim.sim_clear_faults(gpu=1)
    watch.check()
    assert watch.taints() == {} and backs == ["back"]
    assert node.node_events[-1][:2] == ("Normal", "GpuBack")
    assert h100.uuid not in watch.taints()


def test_a_hung_gpu_is_tainted_nvml_timeout_and_the_other_not(node: Node) -> None:
    watch = _watch(node, [], [])
    h100, a100 = node.backend.gpus()
    sim.sim_inject_fault("DeviceGetUUID", hang=True, gpu=0)
    watch.check()
    assert watch.taints() == {
        h100.uuid: ({"key": KEY, "value": "nvml-timeout", "effect": "NoSchedule"},)
    }
    assert a100.uuid not in watch.taints()
    (event,) = node.node_events
    assert event[1] == "GpuUnresponsive" and "the NVML call to read GPU 0" in event[2], event
    sim.sim_release_hangs()
