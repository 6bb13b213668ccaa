"""Registration as the kubelet performs it, over real unix sockets."""

from __future__ import annotations

import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeletplugin._generated import pluginregistration_v1_pb2, pluginregistration_v1_pb2_grpc
from kubeletplugin.registration import SUPPORTED_VERSIONS, SocketPaths
from kubeletplugin.server import PluginServer
from nodesim.kubelet import KubeletSim, RegistrationError, choose_service
from tests.kubeletplugin.fake_preparer import DRIVER, FakePreparer, running_plugin, short_tmpdir


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


def _get_info(reg_socket: Path) -> pluginregistration_v1_pb2.PluginInfo:
    with grpc.insecure_channel(f"unix://{reg_socket}") as channel:
        stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
        info: pluginregistration_v1_pb2.PluginInfo = stub.GetInfo(
            pluginregistration_v1_pb2.InfoRequest(), timeout=5
        )
        return info


def test_sockets_live_where_the_kubelet_looks(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        reg = root / "plugins_registry" / f"{DRIVER}-reg.sock"
        dra = root / "plugins" / DRIVER / "dra.sock"
        assert server.paths == SocketPaths(registration=reg, dra=dra)
        assert reg.is_socket()
        assert dra.is_socket()
        # Only root (the kubelet) may connect.
        assert stat.S_IMODE(reg.stat().st_mode) == 0o600
        assert stat.S_IMODE(dra.stat().st_mode) == 0o600


def test_get_info_answers_what_the_kubelet_checks(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        info = _get_info(server.paths.registration)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(root / "plugins" / DRIVER / "dra.sock")
    assert Path(info.endpoint).is_absolute()
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
        "v1.DRAResourceHealth",
    ]
    assert tuple(info.supported_versions) == SUPPORTED_VERSIONS


def test_kubelet_registers_the_plugin_and_readiness_follows(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        assert not server.registration.notified
        assert not server.wait_registered(timeout=0)
        kubelet = KubeletSim(root / "plugins_registry")
        plugin = kubelet.wait_for_plugin(DRIVER, timeout=5)
        assert plugin.service == "v1.DRAPlugin"
        assert plugin.endpoint == str(server.paths.dra)
        assert server.wait_registered(timeout=5)
        state = server.registration
        assert (state.notified, state.registered, state.error) == (True, True, "")
        kubelet.close()


def test_kubelet_refusal_is_reported_to_the_plugin(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        kubelet = KubeletSim(root / "plugins_registry", supported_services=("v2.DRAPlugin",))
        with pytest.raises(RegistrationError, match="none of the plugin's versions"):
            kubelet.register(server.paths.registration)
        state = server.registration
        assert state.notified
        assert not state.registered
        assert "v2.DRAPlugin" in state.error
        assert not server.wait_registered(timeout=0)
        assert kubelet.plugins == {}
        assert server.paths.registration in kubelet.failures


def test_older_kubelet_falls_back_to_v1beta1(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        kubelet = KubeletSim(root / "plugins_registry", supported_services=("v1beta1.DRAPlugin",))
        plugin = kubelet.register(server.paths.registration)
        assert plugin.service == "v1beta1.DRAPlugin"
        assert server.registration.registered
        kubelet.close()


def test_choose_service_walks_the_plugins_list_in_order() -> None:
    kubelet = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    assert choose_service(SUPPORTED_VERSIONS, kubelet) == "v1.DRAPlugin"
    assert choose_service(["v1beta1.DRAPlugin", "v1.DRAPlugin"], kubelet) == "v1beta1.DRAPlugin"
    assert choose_service(["v1alpha1.DRAResourceHealth", "v1beta1.DRAPlugin"], kubelet) == (
        "v1beta1.DRAPlugin"
    )
    with pytest.raises(RegistrationError):
        choose_service(["v1alpha1.DRAResourceHealth"], kubelet)


_VERSIONS = st.sampled_from(
    ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAPlugin", "v1.DRAResourceHealth", "x"]
)


@given(plugin=st.lists(_VERSIONS, max_size=6), kubelet=st.lists(_VERSIONS, max_size=4))
def test_choose_service_picks_the_first_mutually_supported(
    plugin: list[str], kubelet: list[str]
) -> None:
    common = [v for v in plugin if v in kubelet]
    if not common:
        with pytest.raises(RegistrationError):
            choose_service(plugin, kubelet)
    else:
        assert choose_service(plugin, kubelet) == common[0]


def _stale_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # leaves the socket file behind, as a killed plugin does


def test_stale_sockets_are_replaced_on_start(root: Path) -> None:
    paths = SocketPaths.for_driver(DRIVER, root / "plugins_registry", root / "plugins")
    _stale_socket(paths.registration)
    _stale_socket(paths.dra)
    with running_plugin(root, FakePreparer()):
        assert _get_info(paths.registration).name == DRIVER


def test_a_non_socket_in_the_way_is_refused_not_deleted(root: Path) -> None:
    paths = SocketPaths.for_driver(DRIVER, root / "plugins_registry", root / "plugins")
    paths.dra.parent.mkdir(parents=True)
    paths.dra.write_text("precious")
    server = PluginServer(DRIVER, root / "plugins_registry", root / "plugins", FakePreparer())
    pollers = _health_pollers()
    with pytest.raises(FileExistsError, match="not a socket"):
        server.start()
    assert paths.dra.read_text() == "precious"
    assert not paths.registration.exists()
    assert server.wait(timeout=0)  # a failed start leaves nothing running
    assert _health_pollers() == pollers


def test_a_failed_registration_socket_stops_the_dra_socket_too(root: Path) -> None:
    paths = SocketPaths.for_driver(DRIVER, root / "plugins_registry", root / "plugins")
    paths.registration.parent.mkdir(parents=True)
    paths.registration.mkdir()
    server = PluginServer(DRIVER, root / "plugins_registry", root / "plugins", FakePreparer())
    with pytest.raises(FileExistsError, match="not a socket"):
        server.start()
    assert not paths.dra.exists()
    assert paths.registration.is_dir()


def _health_pollers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "health-poller")


def test_stop_removes_both_sockets_and_the_kubelet_deregisters(root: Path) -> None:
    kubelet = KubeletSim(root / "plugins_registry")
    with running_plugin(root, FakePreparer()) as server:
        kubelet.wait_for_plugin(DRIVER, timeout=5)
        paths = server.paths
    assert not paths.registration.exists()
    assert not paths.dra.exists()
    assert server.wait(timeout=0)
    kubelet.scan()
    assert DRIVER not in kubelet.plugins


def test_restart_on_the_same_directories_registers_again(root: Path) -> None:
    kubelet = KubeletSim(root / "plugins_registry")
    for _ in range(2):
        with running_plugin(root, FakePreparer()) as server:
            kubelet.wait_for_plugin(DRIVER, timeout=5)
            assert server.wait_registered(timeout=5)
        kubelet.scan()
    kubelet.close()


def test_a_socket_recreated_between_scans_is_registered_again(root: Path) -> None:
    # The watcher may never see the gap of a restart: the old socket is gone and the new one is
    # in place at the same path before the next scan. It is still a new plugin to register.
    kubelet = KubeletSim(root / "plugins_registry")
    with running_plugin(root, FakePreparer()):
        first = kubelet.wait_for_plugin(DRIVER, timeout=5)
    time.sleep(0.05)  # a restart is never instant; keeps the change times apart on any clock
    with running_plugin(root, FakePreparer()) as server:
        registered = kubelet.scan()
        assert [p.driver_name for p in registered] == [DRIVER]
        assert kubelet.plugins[DRIVER] is not first
        assert server.wait_registered(timeout=5)
        assert kubelet.scan() == []  # the same incarnation is not registered twice
    kubelet.close()


def test_directories_are_configurable_and_created(root: Path) -> None:
    reg_dir, plugins_dir = root / "a" / "reg", root / "b" / "plug"
    server = PluginServer("gpu.example.com", reg_dir, plugins_dir, FakePreparer())
    server.start()
    try:
        assert (reg_dir / "gpu.example.com-reg.sock").is_socket()
        assert (plugins_dir / "gpu.example.com" / "dra.sock").is_socket()
        assert KubeletSim(reg_dir).wait_for_plugin("gpu.example.com", timeout=5).endpoint == str(
            plugins_dir / "gpu.example.com" / "dra.sock"
        )
    finally:
        server.stop(grace=0)


def test_start_twice_is_refused(root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server, pytest.raises(RuntimeError):
        server.start()


@pytest.mark.parametrize("name", ["", "a/b", ".hidden"])
def test_driver_names_that_cannot_name_a_socket_are_refused(name: str, root: Path) -> None:
    with pytest.raises(ValueError, match="driver name"):
        SocketPaths.for_driver(name, root, root)


def test_socket_paths_beyond_the_unix_limit_are_refused(root: Path) -> None:
    deep = root / ("d" * 120)
    with pytest.raises(ValueError, match="at most 107"):
        SocketPaths.for_driver(DRIVER, deep, root)


def test_relative_directories_give_an_absolute_endpoint(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(root)
    paths = SocketPaths.for_driver(DRIVER, Path("reg"), Path("plugins"))
    assert paths.dra == root / "plugins" / DRIVER / "dra.sock"
    assert paths.registration.is_absolute()
