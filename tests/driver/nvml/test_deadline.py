"""Issue 45, point 1: no NVML call can stall the node.

On the simulator's "hang" fault (a call that does not return until released, as a sick GPU's
calls often do), the backend's per-GPU workers give the caller `GpuUnresponsive` after the
deadline, fail every later call on that GPU at once instead of queueing behind the hung one,
keep the other GPUs going, and say when the GPU answers again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.waiting import wait_for
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.deadline import CallDeadlines
from driver.nvml.errors import GpuUnresponsive

A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
DEADLINE = 0.3


@pytest.fixture
def backend(make_sim: Callable[..., Any]) -> Iterator[NvmlBackend]:
    nv = make_sim([H100, A100])
    b = NvmlBackend(nv, proc_root=nv.sim_proc_root(), timeout=DEADLINE).open()
    yield b
    sim.sim_release_hangs()
    b.close()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException | Any]]:
    out: list[BaseException | Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def test_a_hung_carve_makes_its_gpu_unresponsive_and_leaves_the_other_working(
    backend: NvmlBackend,
) -> None:
    h100, a100 = backend.gpus()
    changes: list[str] = []
    backend.on_responsiveness_change(lambda: changes.append("changed"))
    sim.sim_inject_fault("DeviceCreateGpuInstanceWithPlacement", hang=True, gpu=0)

    started = time.monotonic()
    with pytest.raises(GpuUnresponsive, match="create a MIG instance") as hung:
        backend.carve(h100.uuid, 19, 0)
    assert DEADLINE <= time.monotonic() - started < DEADLINE + 2
    assert hung.value.gpu == h100.uuid and hung.value.call == "create a MIG instance"
    assert [h["gpu"] for h in sim.sim_hung_calls()] == [0]
    assert set(backend.unusable()) == {0} and "unresponsive" in backend.unusable()[0].why
    assert changes == ["changed"]

    # Every later call on the hung GPU fails at once, naming the call that hangs.
    started = time.monotonic()
    with pytest.raises(GpuUnresponsive, match="create a MIG instance"):
        backend.instances(h100.uuid)
    assert time.monotonic() - started < DEADLINE / 2
    # The other GPU is not held up, and enumeration still lists both.
    carved = backend.carve(a100.uuid, 19, 0)
    assert [i.gi_id for i in backend.instances(a100.uuid)] == [carved.gi_id]
    assert [g.index for g in backend.gpus()] == [0, 1]

    # Released: the call ran (a "before" hang does the work once it returns), the GPU answers.
    assert sim.sim_release_hangs(gpu=0) == 1
    wait_for("the hung carve to return", lambda: backend.hung() == {}, timeout=10, interval=0.01)
    assert backend.unusable() == {} and changes == ["changed", "changed"]
    assert [i.placement.start for i in backend.instances(h100.uuid)] == [0]


def test_a_hung_mig_mode_query_at_start_up_leaves_out_that_gpu_only(
    make_sim: Callable[..., Any],
) -> None:
    """A hung MIG-mode query on one GPU used to keep the agent from starting at all."""
    nv = make_sim([H100, A100])
    sim.sim_inject_fault("DeviceGetMigMode", hang=True, gpu=0)
    b = NvmlBackend(nv, proc_root=nv.sim_proc_root(), timeout=DEADLINE).open()
    try:
        assert [g.index for g in b.gpus()] == [1]
        assert "GPU index 0 is unresponsive" in b.unusable()[0].why
        assert "read GPU 0" in b.unusable()[0].why
        assert [g.index for g in b.gpus()] == [1]  # still hung: fails at once, no new wait
        sim.sim_release_hangs()
        wait_for(
            "the hung MIG-mode query to return", lambda: b.hung() == {}, timeout=10, interval=0.01
        )
        assert [g.index for g in b.gpus()] == [0, 1] and b.unusable() == {}
    finally:
        sim.sim_release_hangs()
        b.close()


def test_a_hang_after_the_change_holds_the_answer_with_the_change_made(
    backend: NvmlBackend,
) -> None:
    h100, _ = backend.gpus()
    sim.sim_inject_fault("GpuInstanceDestroy", hang=True, when="after", gpu=0)
    carved = backend.carve(h100.uuid, 19, 0)
    with pytest.raises(GpuUnresponsive, match="destroy a MIG instance"):
        backend.destroy(h100.uuid, carved.gi_id)
    assert sim.sim_release_hangs() == 1
    wait_for("the hung destroy to return", lambda: backend.hung() == {}, timeout=10, interval=0.01)
    assert backend.instances(h100.uuid) == ()


def test_calls_from_inside_a_gpus_worker_run_inline() -> None:
    """One backend method calling another on the same GPU must not wait for its own worker."""
    d = CallDeadlines(1.0)
    assert d.run(0, "GPU-x", "outer", lambda: d.run(0, "GPU-x", "inner", lambda: 7)) == 7
    assert d.hung() == {}


def test_without_a_deadline_calls_run_on_the_callers_thread() -> None:
    d = CallDeadlines(None)
    assert d.run(0, "GPU-x", "read", threading.current_thread) is threading.current_thread()


def test_a_call_queued_behind_a_hung_one_never_runs(tmp_path: Path) -> None:
    """A caller that gave up must not have its call run later, behind the hang: a carve the
    caller no longer waits for would leave an instance nobody records."""
    d = CallDeadlines(0.2)
    gate = threading.Event()
    ran: list[str] = []
    t, _ = _in_thread(lambda: d.run(0, "GPU-x", "hang", gate.wait))
    wait_for(
        "the first call to start", lambda: d.hung() != {} or t.is_alive(), timeout=10, interval=0.01
    )
    with pytest.raises(GpuUnresponsive):
        d.run(0, "GPU-x", "second", lambda: ran.append("second"))
    gate.set()
    t.join(5)
    wait_for("the hang to clear", lambda: d.hung() == {}, timeout=10, interval=0.01)
    assert d.run(0, "GPU-x", "third", lambda: "ok") == "ok" and ran == []
