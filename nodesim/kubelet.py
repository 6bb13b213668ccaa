"""The kubelet's side of the DRA plugin protocol, as test tooling (not part of the product).

It does what the kubelet's plugin watcher and DRA manager do, in the same order and with the same
checks: find `*-reg.sock` in the registry directory, call GetInfo, check the plugin type, pick the
first entry of the plugin's supported_versions that the kubelet supports, connect to the
advertised endpoint, report the outcome with NotifyRegistrationStatus, then call
NodePrepareResources / NodeUnprepareResources with the kubelet's 45 s timeout and watch health.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kubeletplugin._generated import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from kubeletplugin.ports import ClaimRef, PreparedDevice, PrepareResult

_log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# The kubelet's own preference list (servicesSupportedByKubelet); order does not matter to it,
# the plugin's order does.
KUBELET_SERVICES: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICES: tuple[str, ...] = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
CALL_TIMEOUT = 45.0


class RegistrationError(Exception):
    """The plugin's answer would make the kubelet refuse it."""


@dataclass(frozen=True)
class DeviceHealthStatus:
    pool: str
    device: str
    health: str  # "UNKNOWN" | "HEALTHY" | "UNHEALTHY"
    last_updated_time: int
    health_check_timeout_seconds: int
    message: str


def choose_service(plugin_versions: Sequence[str], kubelet_versions: Sequence[str]) -> str:
    """Walk the plugin's list in order and return the first version the kubelet supports."""
    for version in plugin_versions:
        if version in kubelet_versions:
            return version
    raise RegistrationError(
        f"none of the plugin's versions {list(plugin_versions)} is supported by the kubelet "
        f"({list(kubelet_versions)})"
    )


def _channel(socket: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{socket}")


class RegisteredPlugin:
    """A DRA plugin the simulated kubelet has accepted; the handle the node agent drives."""

    def __init__(
        self,
        registration_socket: Path,
        info: pluginregistration_v1_pb2.PluginInfo,
        service: str,
        timeout: float,
        socket_identity: SocketIdentity | None = None,
    ) -> None:
        self.registration_socket = registration_socket
        # Which incarnation of the registration socket this registration came from; a socket
        # re-created at the same path is a new plugin to the watcher.
        self.socket_identity = socket_identity
        self.driver_name = info.name
        self.endpoint = info.endpoint
        self.supported_versions = tuple(info.supported_versions)
        self.service = service
        self.timeout = timeout
        self._channel = _channel(info.endpoint)
        if service == "v1.DRAPlugin":
            self._v1 = dra_v1_pb2_grpc.DRAPluginStub(self._channel)  # type: ignore[no-untyped-call]
        else:
            self._v1beta1 = dra_v1beta1_pb2_grpc.DRAPluginStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """NodePrepareResources; raises grpc.RpcError when the call itself fails."""
        if self.service == "v1.DRAPlugin":
            req1 = dra_v1_pb2.NodePrepareResourcesRequest(claims=[_wire_v1(c) for c in claims])
            resp1 = self._v1.NodePrepareResources(req1, timeout=self.timeout)
            return {uid: _result_v1(r) for uid, r in resp1.claims.items()}
        req = dra_v1beta1_pb2.NodePrepareResourcesRequest(claims=[_wire_v1beta1(c) for c in claims])
        resp = self._v1beta1.NodePrepareResources(req, timeout=self.timeout)
        return {uid: _result_v1beta1(r) for uid, r in resp.claims.items()}

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """NodeUnprepareResources; uid -> error ("" = done)."""
        if self.service == "v1.DRAPlugin":
            req1 = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[_wire_v1(c) for c in claims])
            resp1 = self._v1.NodeUnprepareResources(req1, timeout=self.timeout)
            return {uid: r.error for uid, r in resp1.claims.items()}
        req = dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
            claims=[_wire_v1beta1(c) for c in claims]
        )
        resp = self._v1beta1.NodeUnprepareResources(req, timeout=self.timeout)
        return {uid: r.error for uid, r in resp.claims.items()}

    def health_service(self) -> str | None:
        """The health API version the plugin advertises, preferring v1; None if it has none."""
        for version in HEALTH_SERVICES:
            if version in self.supported_versions:
                return version
        return None

    def watch_health(
        self, version: str | None = None, timeout: float | None = None
    ) -> Iterator[list[DeviceHealthStatus]]:
        """Stream NodeWatchResources; each item is the plugin's complete device-health list.

        Stop by closing the generator (or when `timeout` ends the call).
        """
        version = version or self.health_service()
        if version not in HEALTH_SERVICES:
            raise RegistrationError(f"plugin does not serve a health API (asked for {version})")
        if version not in self.supported_versions:
            raise RegistrationError(f"plugin does not advertise {version}")
        if version == "v1.DRAResourceHealth":
            stub = dra_health_v1_pb2_grpc.DRAResourceHealthStub(self._channel)  # type: ignore[no-untyped-call]
            request: object = dra_health_v1_pb2.NodeWatchResourcesRequest()
            names = dra_health_v1_pb2.HealthStatus
        else:
            stub = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(self._channel)  # type: ignore[no-untyped-call,assignment]
            request = dra_health_v1alpha1_pb2.NodeWatchResourcesRequest()
            names = dra_health_v1alpha1_pb2.HealthStatus  # type: ignore[assignment]
        stream = stub.NodeWatchResources(request, timeout=timeout)
        try:
            for message in stream:
                yield [
                    DeviceHealthStatus(
                        pool=d.device.pool_name,
                        device=d.device.device_name,
                        health=names.Name(d.health),
                        last_updated_time=d.last_updated_time,
                        health_check_timeout_seconds=d.health_check_timeout_seconds,
                        message=d.message,
                    )
                    for d in message.devices
                ]
        finally:
            stream.cancel()


def _wire_v1(claim: ClaimRef) -> dra_v1_pb2.Claim:
    return dra_v1_pb2.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)


def _wire_v1beta1(claim: ClaimRef) -> dra_v1beta1_pb2.Claim:
    return dra_v1beta1_pb2.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)


def _result_v1(r: dra_v1_pb2.NodePrepareResourceResponse) -> PrepareResult:
    return PrepareResult(
        error=r.error,
        devices=tuple(
            PreparedDevice(
                request_names=tuple(d.request_names),
                pool_name=d.pool_name,
                device_name=d.device_name,
                cdi_device_ids=tuple(d.cdi_device_ids),
                share_id=d.share_id if d.HasField("share_id") else None,
            )
            for d in r.devices
        ),
    )


def _result_v1beta1(r: dra_v1beta1_pb2.NodePrepareResourceResponse) -> PrepareResult:
    return PrepareResult(
        error=r.error,
        devices=tuple(
            PreparedDevice(
                request_names=tuple(d.request_names),
                pool_name=d.pool_name,
                device_name=d.device_name,
                cdi_device_ids=tuple(d.cdi_device_ids),
            )
            for d in r.devices
        ),
    )


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except FileNotFoundError:
        return False


SocketIdentity = tuple[int, int, int]


def socket_identity(path: Path) -> SocketIdentity | None:
    """What tells one incarnation of a socket file from the next one at the same path.

    The kubelet's plugin watcher reacts to the create event of a re-created socket; a scanner
    has to notice the new file instead. The inode alone is not enough (a file system reuses a
    freed inode at once), so the change time goes with it. None when the path is gone.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class KubeletSim:
    """Registers DRA plugins found in a registry directory, as the kubelet's plugin watcher does."""

    def __init__(
        self,
        registry_dir: Path,
        *,
        supported_services: Sequence[str] = KUBELET_SERVICES,
        timeout: float = CALL_TIMEOUT,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.supported_services = tuple(supported_services)
        self.timeout = timeout
        self._plugins: dict[str, RegisteredPlugin] = {}
        # Refused registration sockets: path -> (socket identity, reason). A refused plugin is
        # retried only when its socket is re-created, as the watcher sees a new plugin then.
        self._refused: dict[Path, tuple[SocketIdentity | None, str]] = {}
        self._lock = threading.Lock()

    @property
    def plugins(self) -> Mapping[str, RegisteredPlugin]:
        """Registered plugins by driver name."""
        with self._lock:
            return dict(self._plugins)

    @property
    def failures(self) -> Mapping[Path, str]:
        """Registration sockets the kubelet refused, with the reason it reported to the plugin."""
        with self._lock:
            return {path: reason for path, (_, reason) in self._refused.items()}

    def register(self, socket: Path) -> RegisteredPlugin:
        """Run the registration handshake against one registration socket."""
        # Read before the handshake: a socket re-created during it is then seen as new next scan.
        identity = socket_identity(socket)
        channel = _channel(str(socket))
        try:
            stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            info = stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=self.timeout)
            try:
                plugin = self._validate(socket, info, identity)
            except RegistrationError as exc:
                stub.NotifyRegistrationStatus(
                    pluginregistration_v1_pb2.RegistrationStatus(
                        plugin_registered=False, error=str(exc)
                    ),
                    timeout=self.timeout,
                )
                self._refuse(socket, str(exc))
                raise
            stub.NotifyRegistrationStatus(
                pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=True),
                timeout=self.timeout,
            )
        finally:
            channel.close()
        with self._lock:
            old = self._plugins.pop(plugin.driver_name, None)
            self._plugins[plugin.driver_name] = plugin
            self._refused.pop(socket, None)
        if old is not None:
            old.close()
        _log.info(
            "registered DRA plugin %s at %s using %s",
            plugin.driver_name,
            plugin.endpoint,
            plugin.service,
        )
        return plugin

    def _validate(
        self,
        socket: Path,
        info: pluginregistration_v1_pb2.PluginInfo,
        identity: SocketIdentity | None,
    ) -> RegisteredPlugin:
        if info.type != PLUGIN_TYPE:
            raise RegistrationError(f"plugin type {info.type!r} is not {PLUGIN_TYPE!r}")
        if not info.name:
            raise RegistrationError("plugin did not report a driver name")
        if not os.path.isabs(info.endpoint):
            raise RegistrationError(f"endpoint {info.endpoint!r} is not an absolute path")
        service = choose_service(info.supported_versions, self.supported_services)
        if not _is_socket(Path(info.endpoint)):
            raise RegistrationError(f"endpoint {info.endpoint} is not a socket")
        return RegisteredPlugin(socket, info, service, self.timeout, identity)

    def scan(self) -> list[RegisteredPlugin]:
        """One pass of the plugin watcher: register new and re-created sockets, drop vanished ones.

        Returns the plugins registered in this pass.
        """
        found = sorted(
            p
            for p in self.registry_dir.glob("*-reg.sock")
            if not p.name.startswith(".") and _is_socket(p)
        )
        registered: list[RegisteredPlugin] = []
        with self._lock:
            known = {p.registration_socket: p for p in self._plugins.values()}
            gone = [p.driver_name for sock, p in known.items() if sock not in found]
            for name in gone:
                self._plugins.pop(name).close()
                _log.info("plugin %s deregistered: its registration socket vanished", name)
        for socket in found:
            identity = socket_identity(socket)
            current = known.get(socket)
            if current is not None and current.socket_identity == identity:
                continue
            if self._refused_before(socket):
                continue
            try:
                registered.append(self.register(socket))
            except (RegistrationError, grpc.RpcError) as exc:
                _log.warning("registration via %s failed: %s", socket, exc)
                if socket not in self.failures:
                    self._refuse(socket, str(exc))
        return registered

    def _refuse(self, socket: Path, reason: str) -> None:
        identity = socket_identity(socket)
        with self._lock:
            self._refused[socket] = (identity, reason)

    def _refused_before(self, socket: Path) -> bool:
        identity = socket_identity(socket)
        if identity is None:
            return True
        with self._lock:
            refused = self._refused.get(socket)
        return refused is not None and refused[0] == identity

    def wait_for_plugin(
        self, driver_name: str, timeout: float = 10.0, poll: float = 0.05
    ) -> RegisteredPlugin:
        """Watch the registry directory until `driver_name` is registered."""
        deadline = time.monotonic() + timeout
        while True:
            self.scan()
            plugin = self.plugins.get(driver_name)
            if plugin is not None:
                return plugin
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no DRA plugin {driver_name!r} registered via {self.registry_dir} within "
                    f"{timeout}s; refused: {dict(self.failures)}"
                )
            time.sleep(poll)

    def close(self) -> None:
        with self._lock:
            plugins, self._plugins = list(self._plugins.values()), {}
        for plugin in plugins:
            plugin.close()
