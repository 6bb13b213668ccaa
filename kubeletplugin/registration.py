"""Kubelet plugin registration: the `pluginregistration.Registration` service and socket paths.

The kubelet's plugin watcher finds `<driver>-reg.sock` in its plugins_registry directory, calls
GetInfo, validates the answer, connects to the advertised endpoint and reports the outcome through
NotifyRegistrationStatus. That report is the only sign this plugin gets that the kubelet will
send it work, so it is kept as the plugin's readiness.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from kubeletplugin._generated import pluginregistration_v1_pb2, pluginregistration_v1_pb2_grpc

_log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"

# The kubelet walks this list in order and uses the first DRAPlugin version it supports, so v1
# must come first. The health services are listed so the kubelet knows it may watch them.
SUPPORTED_VERSIONS: tuple[str, ...] = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1alpha1.DRAResourceHealth",
    "v1.DRAResourceHealth",
)

# sun_path is 108 bytes on Linux including the terminating NUL.
_MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class SocketPaths:
    """Where the plugin listens; both paths are absolute."""

    registration: Path
    dra: Path

    @classmethod
    def for_driver(cls, driver_name: str, registry_dir: Path, plugins_dir: Path) -> SocketPaths:
        if not driver_name or "/" in driver_name or driver_name.startswith("."):
            raise ValueError(
                f"driver name {driver_name!r} cannot name a socket file: it must be non-empty, "
                "contain no '/', and not start with '.'"
            )
        paths = cls(
            registration=registry_dir.absolute() / f"{driver_name}-reg.sock",
            dra=plugins_dir.absolute() / driver_name / "dra.sock",
        )
        for path in (paths.registration, paths.dra):
            if len(str(path).encode()) > _MAX_SOCKET_PATH:
                raise ValueError(
                    f"socket path {path} is {len(str(path).encode())} bytes; unix sockets allow "
                    f"at most {_MAX_SOCKET_PATH}: choose a shorter directory"
                )
        return paths


@dataclass(frozen=True)
class RegistrationState:
    """What the kubelet last told us. `notified` is False until the kubelet has called at all."""

    notified: bool = False
    registered: bool = False
    error: str = ""


class RegistrationService(pluginregistration_v1_pb2_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher and records its verdict."""

    def __init__(self, driver_name: str, endpoint: Path) -> None:
        self._info = pluginregistration_v1_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver_name,
            endpoint=str(endpoint),
            supported_versions=SUPPORTED_VERSIONS,
        )
        self._lock = threading.Lock()
        self._state = RegistrationState()
        self._registered = threading.Event()

    @property
    def state(self) -> RegistrationState:
        with self._lock:
            return self._state

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until the kubelet reports a successful registration; False on timeout."""
        return self._registered.wait(timeout)

    def GetInfo(  # noqa: N802 (gRPC method name)
        self, request: pluginregistration_v1_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> pluginregistration_v1_pb2.PluginInfo:
        _log.info(
            "kubelet asked for plugin info: %s at %s, versions %s",
            self._info.name,
            self._info.endpoint,
            list(self._info.supported_versions),
        )
        return self._info

    def NotifyRegistrationStatus(  # noqa: N802 (gRPC method name)
        self, request: pluginregistration_v1_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> pluginregistration_v1_pb2.RegistrationStatusResponse:
        state = RegistrationState(
            notified=True, registered=request.plugin_registered, error=request.error
        )
        with self._lock:
            self._state = state
        if state.registered:
            self._registered.set()
            _log.info("kubelet registered plugin %s", self._info.name)
        else:
            self._registered.clear()
            _log.error(
                "kubelet rejected plugin %s: %s", self._info.name, state.error or "(no reason)"
            )
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


def add_registration_service(server: grpc.Server, service: RegistrationService) -> None:
    add = pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server
    add(service, server)  # type: ignore[no-untyped-call]
