"""The node agent's GPU health monitor on the simulator: NVML events and polls become device
taints in the ResourceSlices and unhealthy devices in the kubelet's health stream, and go away
after a reset (issue 11, point 2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.gpuhealth import HealthPolicy, TaintEffect
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.gpuhealth import HealthMonitor
from kubeletplugin.healthstate import HealthStateFile
from kubeletplugin.nodehardware import NodeHardware
from kubeletplugin.options import parse_options
from process.flags import UsageError
from tests.kubeletplugin.node_harness import sim_config

DRIVER = "mig.carve.dev"
KEY = f"{DRIVER}/gpu-unhealthy"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def hw(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NodeHardware]:
    options = getattr(request, "param", {})
    sim.configure(sim_config(tmp_path, ["H100-SXM5-80GB", "A100-SXM4-40GB"], **options))
    h = NodeHardware(NvmlBackend(sim, proc_root=sim.sim_proc_root()).open())
    yield h
    h.close()
    sim.configure(None)


class NodeEventLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def event(self, *, type_: str, reason: str, message: str, action: str = "GpuHealth") -> None:
        self.events.append((type_, reason, message))


def _monitor(
    hw: NodeHardware,
    clock: Clock,
    *,
    state: HealthStateFile | None = None,
    events: NodeEventLog | None = None,
    **policy: object,
) -> tuple[HealthMonitor, list[int]]:
    changes: list[int] = []
    m = HealthMonitor(
        hw.mig,
        [g.uuid for g in hw.mig.gpus()],
        policy=HealthPolicy(**policy),  # type: ignore[arg-type]
        taint_key=KEY,
        poll_seconds=0.2,
        on_change=lambda: changes.append(1),
        clock=clock,
        state=state,
        events=events,
    )
    m.start()
    return m, changes


def _tainted(hw: NodeHardware, m: HealthMonitor) -> dict[str, set[str]]:
    """Device name -> the effects of its taints, for every tainted published device."""
    slices = hw.resource_slices(
        driver=DRIVER,
        node_name="n",
        generation=1,
        split=True,
        taints=m.taints(),
        device_taints=m.device_taints(),
    )
    return {
        d["name"]: {t["effect"] for t in d["taints"]}
        for s in slices
        for d in s["spec"].get("devices") or ()
        if d.get("taints")
    }


def _until(m: HealthMonitor, clock: Clock, done: object, steps: int = 40) -> None:
    for _ in range(steps):
        if callable(done) and done():
            return
        clock.now += 0.25
        m.step()
    raise AssertionError("condition not reached")


def test_a_fatal_xid_taints_every_device_no_execute_until_the_gpu_is_reset(
    hw: NodeHardware,
) -> None:
    clock = Clock()
    m, changes = _monitor(hw, clock)
    try:
        assert m.taints() == {} and _tainted(hw, m) == {}
        sim.sim_inject_xid(1, 79)
        _until(m, clock, m.taints)
        a100 = hw.mig.gpus()[1].uuid
        assert m.taints() == {a100: ({"key": KEY, "value": "xid-79", "effect": "NoExecute"},)}
        tainted = _tainted(hw, m)
        assert tainted and all(n.startswith("gpu-1") for n in tainted)
        assert set().union(*tainted.values()) == {"NoExecute"}
        source = hw.health_source(DRIVER, "n", dict, sick=m.unhealthy)
        sick = [(name, why) for _, name, ok, why in source() if not ok]
        assert sick and all(n.startswith("gpu-1") and "XID 79" in w for n, w in sick)
        clock.now += 3600
        m.step()
        assert m.taints()  # time does not heal a fatal error
        sim.sim_reset_gpu(1)
        _until(m, clock, lambda: not m.taints())
        assert _tainted(hw, m) == {} and len(changes) == 2
    finally:
        m.stop()


def test_a_degraded_gpu_gets_no_schedule_and_recovers_after_a_quiet_period(
    hw: NodeHardware,
) -> None:
    clock = Clock()
    m, _ = _monitor(hw, clock, recovery_seconds=60.0)
    try:
        sim.sim_inject_xid(0, 31)  # an application's page fault: ignored
        sim.sim_inject_xid(0, 92)
        _until(m, clock, m.taints)
        assert set().union(*_tainted(hw, m).values()) == {"NoSchedule"}
        clock.now += 61
        m.poll()
        if m.taints():
            # The monitor's own thread may have taken the event from NVML before the jump and
            # read the clock after it (seen under load): the quiet period then starts at the
            # jump. One more quiet period must still clear it.
            clock.now += 61
            m.poll()
        assert m.taints() == {}
    finally:
        m.stop()


@pytest.mark.parametrize("hw", [{"health_events": False}], indirect=True)
def test_without_events_the_poll_finds_a_gpu_that_needs_a_reset(hw: NodeHardware) -> None:
    clock = Clock()
    m, _ = _monitor(hw, clock, fatal_effect=TaintEffect.NO_SCHEDULE)
    try:
        sim.sim_inject_ecc(0, uncorrected=True)
        _until(m, clock, m.taints)
        assert set().union(*_tainted(hw, m).values()) == {"NoSchedule"}  # as configured
        sim.sim_reset_gpu(0)
        _until(m, clock, lambda: not m.taints())
    finally:
        m.stop()


def test_the_node_is_told_when_a_gpu_turns_unhealthy_and_healthy_again(hw: NodeHardware) -> None:
    clock, told = Clock(), NodeEventLog()
    m, _ = _monitor(hw, clock, events=told)
    a100 = hw.mig.gpus()[1].uuid
    try:
        sim.sim_inject_xid(1, 79)
        _until(m, clock, m.taints)
        sim.sim_inject_xid(1, 79)  # the same condition again: nothing new to say
        for _ in range(4):
            clock.now += 0.25
            m.step()
        sim.sim_reset_gpu(1)
        _until(m, clock, lambda: not m.taints())
    finally:
        m.stop()
    assert [(t, r) for t, r, _ in told.events] == [
        ("Warning", "GpuUnhealthy"),
        ("Normal", "GpuHealthy"),
    ]
    sick, healthy = told.events[0][2], told.events[1][2]
    assert sick.startswith(f"GPU {a100}: XID 79 (GPU has fallen off the bus)")
    assert f"tainted {KEY}=xid-79:NoExecute" in sick and "until the GPU is reset" in sick
    assert healthy.startswith(f"GPU {a100} is healthy again")


def test_a_restarted_monitor_keeps_a_degraded_gpu_tainted(hw: NodeHardware, tmp_path: Path) -> None:
    """The XID event is gone once read, so only the saved condition still knows of it."""
    clock, state = Clock(), HealthStateFile(tmp_path / "gpu-health.json")
    first, _ = _monitor(hw, clock, state=state, recovery_seconds=60.0)
    try:
        sim.sim_inject_xid(0, 92)
        _until(first, clock, first.taints)
    finally:
        first.stop()
    told = NodeEventLog()
    clock.now += 30
    second, _ = _monitor(hw, clock, state=state, events=told, recovery_seconds=60.0)
    try:
        assert set().union(*_tainted(hw, second).values()) == {"NoSchedule"}  # at once
        assert told.events == []  # the node was told by the first run
        clock.now += 31  # 61 s after the error, not 61 s after the restart
        second.poll()
        assert second.taints() == {}
        assert [r for _, r, _ in told.events] == ["GpuHealthy"]
    finally:
        second.stop()
    assert HealthStateFile(tmp_path / "gpu-health.json").load().gpus == {}


def test_a_reset_while_the_plugin_was_down_is_seen_at_start(
    hw: NodeHardware, tmp_path: Path
) -> None:
    clock, state = Clock(), HealthStateFile(tmp_path / "gpu-health.json")
    first, _ = _monitor(hw, clock, state=state)
    try:
        sim.sim_inject_xid(1, 79)
        _until(first, clock, first.taints)
    finally:
        first.stop()
    assert state.load().gpus[hw.mig.gpus()[1].uuid].recovery_asked
    sim.sim_reset_gpu(1)
    second, _ = _monitor(hw, clock, state=state)
    try:
        assert second.taints() == {}  # the first poll saw the recovery action back to none
    finally:
        second.stop()


def test_an_xid_of_one_mig_instance_taints_only_its_device_until_it_is_destroyed(
    hw: NodeHardware,
) -> None:
    clock, told = Clock(), NodeEventLog()
    m, _ = _monitor(hw, clock, events=told)
    h100 = hw.mig.gpus()[0]
    sick = hw.mig.carve(h100.uuid, 19, 2)  # 1g.10gb at 2
    fine = hw.mig.carve(h100.uuid, 19, 3)
    sick_device = f"gpu-0-mig-1g10gb-19-{sick.placement.start}"
    try:
        sim.sim_inject_xid(0, 94, gpu_instance=sick.gi_id)  # a contained ECC error
        _until(m, clock, m.device_taints)
        assert m.taints() == {}  # the GPU itself is fine
        assert _tainted(hw, m) == {sick_device: {"NoSchedule"}}
        source = hw.health_source(
            DRIVER, "n", dict, sick=m.unhealthy, sick_devices=m.unhealthy_devices
        )
        bad = [(name, why) for _, name, ok, why in source() if not ok]
        assert bad == [(sick_device, f"XID 94 (contained ECC error) in GPU instance {sick.gi_id}")]
        hw.mig.destroy(h100.uuid, sick.gi_id)  # the pod ended, the slice was released
        _until(m, clock, lambda: not m.device_taints())
        assert _tainted(hw, m) == {}
    finally:
        m.stop()
    assert [r for _, r, _ in told.events] == ["GpuUnhealthy", "GpuHealthy"]
    assert f"GPU {h100.uuid} instance {sick.gi_id} is healthy again" in told.events[1][2]
    assert "its device is tainted" in told.events[0][2]
    hw.mig.destroy(h100.uuid, fine.gi_id)


def test_a_fatal_xid_of_one_instance_is_the_whole_gpus(hw: NodeHardware) -> None:
    """Its fix, a reset, takes every instance of the GPU."""
    clock = Clock()
    m, _ = _monitor(hw, clock)
    h100 = hw.mig.gpus()[0]
    one = hw.mig.carve(h100.uuid, 19, 0)
    try:
        sim.sim_inject_xid(0, 95, gpu_instance=one.gi_id)  # uncontained ECC error
        _until(m, clock, m.taints)
        assert m.device_taints() == {}
        assert set(m.taints()) == {h100.uuid}
    finally:
        m.stop()
        hw.mig.destroy(h100.uuid, one.gi_id)


def test_an_instance_re_created_while_the_plugin_was_down_is_healthy(
    hw: NodeHardware, tmp_path: Path
) -> None:
    clock, state = Clock(), HealthStateFile(tmp_path / "gpu-health.json")
    h100 = hw.mig.gpus()[0]
    first, _ = _monitor(hw, clock, state=state)
    sick = hw.mig.carve(h100.uuid, 19, 4)
    try:
        sim.sim_inject_xid(0, 94, gpu_instance=sick.gi_id)
        _until(first, clock, first.device_taints)
    finally:
        first.stop()
    second, _ = _monitor(hw, clock, state=state)  # the instance is still there: still sick
    try:
        assert _tainted(hw, second) == {
            f"gpu-0-mig-1g10gb-19-{sick.placement.start}": {"NoSchedule"}
        }
    finally:
        second.stop()
    hw.mig.destroy(h100.uuid, sick.gi_id)
    again = hw.mig.carve(h100.uuid, 9, 4)  # a 3g.40gb that may reuse the GI id
    third, _ = _monitor(hw, clock, state=state)
    try:
        assert third.device_taints() == {} and _tainted(hw, third) == {}
    finally:
        third.stop()
        hw.mig.destroy(h100.uuid, again.gi_id)


def test_an_xid_for_a_missing_instance_is_refused_by_the_simulator(hw: NodeHardware) -> None:
    with pytest.raises(sim.SimConfigError, match=r"GPU 0 has no GPU instance 9 \(it has none\)"):
        sim.sim_inject_xid(0, 94, gpu_instance=9)


def test_health_flags_are_checked_with_a_specific_message() -> None:
    o = parse_options(["--node-name=n", "--degraded-taint-effect=None", "--fatal-xids=79"], {})
    assert o.health.degraded_effect is TaintEffect.NONE and o.health.fatal_xids == {79}
    with pytest.raises(UsageError, match=r"unknown taint effect .Evict.*NoSchedule"):
        parse_options(["--node-name=n", "--fatal-taint-effect=Evict"], {})
    with pytest.raises(UsageError, match="'x' is not an XID"):
        parse_options(["--node-name=n", "--ignored-xids=13,x"], {})
    with pytest.raises(UsageError, match=r"XIDs \[79\] are both fatal and ignored"):
        parse_options(["--node-name=n", "--ignored-xids=79"], {})
