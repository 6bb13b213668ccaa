"""DRAResourceHealth v1alpha1 and v1 streams over real unix sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import pytest

from kubeletplugin.health import DeviceHealthReport, HealthBroadcaster
from kubeletplugin.server import PluginServer
from nodesim.kubelet import DeviceHealthStatus, KubeletSim, RegisteredPlugin
from tests.kubeletplugin.fake_preparer import DRIVER, FakePreparer, running_plugin, short_tmpdir

HEALTH_VERSIONS = ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]


class _Devices:
    """A mutable health source, as the NVML health checker will be."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: list[tuple[str, str, bool, str]] = [
            ("node-a-gpu-0", "gpu-0", True, ""),
            ("node-a-gpu-0", "gpu-0-mig-1g10gb-19-0", True, ""),
        ]
        self.fail = False

    def __call__(self) -> Sequence[tuple[str, str, bool, str]]:
        with self.lock:
            if self.fail:
                raise RuntimeError("NVML event set broken")
            return list(self.entries)


@pytest.fixture
def devices() -> _Devices:
    return _Devices()


@pytest.fixture
def plugin(devices: _Devices) -> Iterator[RegisteredPlugin]:
    with short_tmpdir() as root:
        server = PluginServer(
            DRIVER,
            root / "plugins_registry",
            root / "plugins",
            FakePreparer(),
            devices,
            health_poll_interval=0.05,
            health_resend_interval=0.3,
        )
        server.start()
        kubelet = KubeletSim(root / "plugins_registry")
        try:
            yield kubelet.wait_for_plugin(DRIVER, timeout=5)
        finally:
            kubelet.close()
            server.stop(grace=0.2)


def _summary(report: list[DeviceHealthStatus]) -> list[tuple[str, str, str, str]]:
    return [(d.pool, d.device, d.health, d.message) for d in report]


@pytest.mark.parametrize("version", HEALTH_VERSIONS)
def test_first_message_is_the_full_list(plugin: RegisteredPlugin, version: str) -> None:
    before = int(time.time())
    stream = plugin.watch_health(version, timeout=5)
    first = next(stream)
    stream.close()
    assert _summary(first) == [
        ("node-a-gpu-0", "gpu-0", "HEALTHY", ""),
        ("node-a-gpu-0", "gpu-0-mig-1g10gb-19-0", "HEALTHY", ""),
    ]
    for entry in first:
        assert before - 1 <= entry.last_updated_time <= int(time.time())
        assert entry.health_check_timeout_seconds >= 30


@pytest.mark.parametrize("version", HEALTH_VERSIONS)
def test_a_change_is_streamed_with_the_complete_list(
    plugin: RegisteredPlugin, devices: _Devices, version: str
) -> None:
    stream = plugin.watch_health(version, timeout=5)
    next(stream)
    with devices.lock:
        devices.entries[1] = ("node-a-gpu-0", "gpu-0-mig-1g10gb-19-0", False, "XID 79")
    # A resend of the old list may overtake the change on a loaded machine; the change must follow.
    for _ in range(10):
        changed = next(stream)
        if any(d.health == "UNHEALTHY" for d in changed):
            break
    stream.close()
    assert _summary(changed) == [
        ("node-a-gpu-0", "gpu-0", "HEALTHY", ""),
        ("node-a-gpu-0", "gpu-0-mig-1g10gb-19-0", "UNHEALTHY", "XID 79"),
    ]


def test_the_list_is_resent_without_changes(plugin: RegisteredPlugin) -> None:
    stream = plugin.watch_health(timeout=5)
    started = time.monotonic()
    first, second = next(stream), next(stream)
    elapsed = time.monotonic() - started
    stream.close()
    assert _summary(first) == _summary(second)
    assert elapsed >= 0.2  # a resend, not a change notification


def test_a_failing_source_keeps_the_last_list(plugin: RegisteredPlugin, devices: _Devices) -> None:
    stream = plugin.watch_health(timeout=5)
    first = next(stream)
    devices.fail = True
    resent = next(stream)
    stream.close()
    assert _summary(resent) == _summary(first)


def test_the_plugin_advertises_v1_health_first_for_a_current_kubelet(
    plugin: RegisteredPlugin,
) -> None:
    assert plugin.health_service() == "v1.DRAResourceHealth"


def test_streams_end_when_the_plugin_stops(devices: _Devices) -> None:
    with short_tmpdir() as root:
        with running_plugin(root, FakePreparer(), health=[("p", "d", True, "")]) as server:
            plugin = KubeletSim(root / "plugins_registry").wait_for_plugin(DRIVER, timeout=5)
            stream = plugin.watch_health(timeout=10)
            next(stream)
            started = time.monotonic()
            server.stop(grace=0.2)
        with pytest.raises(grpc.RpcError) as failure:
            next(stream)
        assert time.monotonic() - started < 5
        assert failure.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


def test_broadcaster_rejects_non_positive_intervals() -> None:
    with pytest.raises(ValueError, match="positive"):
        HealthBroadcaster(list, poll_interval=0)


def test_broadcaster_accepts_plain_tuples_and_named_reports() -> None:
    reports = [DeviceHealthReport("p", "d", False, "hot"), ("p", "e", True, "")]
    broadcaster = HealthBroadcaster(lambda: reports, clock=lambda: 1000.0)
    broadcaster.refresh()
    checked_at, snapshot = next(broadcaster.watch(lambda: True))
    assert checked_at == 1000
    assert snapshot == (
        DeviceHealthReport("p", "d", False, "hot"),
        DeviceHealthReport("p", "e", True, ""),
    )
