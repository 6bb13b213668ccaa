"""Run the plugin's two gRPC endpoints: the DRA socket and the registration socket.

Order matters to the kubelet. The DRA socket (DRAPlugin v1/v1beta1 and DRAResourceHealth) starts
first, so that when the plugin watcher sees the registration socket and connects to the advertised
endpoint, it is already served. On stop the registration socket goes first, so the kubelet
deregisters the plugin before the DRA endpoint disappears.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from concurrent import futures
from pathlib import Path

import grpc

from kubeletplugin.draservice import add_dra_services
from kubeletplugin.health import HealthBroadcaster, HealthSource, add_health_services
from kubeletplugin.ports import ClaimPreparer
from kubeletplugin.registration import (
    RegistrationService,
    RegistrationState,
    SocketPaths,
    add_registration_service,
)

_log = logging.getLogger(__name__)

SOCKET_MODE = 0o600


def _remove_stale_socket(path: Path) -> None:
    """Delete a socket left by a previous run; refuse to delete anything that is not a socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(
            f"{path} exists and is not a socket; remove it by hand if it is safe to do so"
        )
    path.unlink()
    _log.info("removed stale socket %s", path)


class PluginServer:
    """The kubelet-facing side of the node agent; lifecycle start() -> wait() -> stop()."""

    def __init__(
        self,
        driver_name: str,
        registry_dir: Path,
        plugins_dir: Path,
        preparer: ClaimPreparer,
        health_source: HealthSource | None = None,
        *,
        max_workers: int = 16,
        health_poll_interval: float = 5.0,
        health_resend_interval: float = 30.0,
    ) -> None:
        self.driver_name = driver_name
        self.paths = SocketPaths.for_driver(driver_name, Path(registry_dir), Path(plugins_dir))
        self._preparer = preparer
        self._health = HealthBroadcaster(
            health_source if health_source is not None else list,
            poll_interval=health_poll_interval,
            resend_interval=health_resend_interval,
        )
        self._max_workers = max_workers
        self._registration = RegistrationService(driver_name, self.paths.dra)
        self._dra_server: grpc.Server | None = None
        self._reg_server: grpc.Server | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    @property
    def registration(self) -> RegistrationState:
        """The kubelet's last registration verdict; feeds /readyz."""
        return self._registration.state

    def wait_registered(self, timeout: float | None = None) -> bool:
        return self._registration.wait_registered(timeout)

    def _new_server(self, path: Path, name: str) -> grpc.Server:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(path)
        return grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self._max_workers, thread_name_prefix=f"grpc-{name}"
            )
        )

    def _bind(self, server: grpc.Server, path: Path, name: str) -> None:
        try:
            server.add_insecure_port(f"unix://{path}")
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {name} socket {path}: {exc}") from exc
        # Only the kubelet (root) may connect: whoever can talk to these sockets can make the
        # plugin carve and hand out GPUs. gRPC creates the socket at bind; nothing is served
        # on it before start.
        os.chmod(path, SOCKET_MODE)
        server.start()
        _log.info("serving %s on %s", name, path)

    def start(self) -> None:
        with self._lock:
            if self._dra_server is not None:
                raise RuntimeError("plugin server already started")
            self._stopped.clear()
            try:
                self._health.start()
                self._dra_server = self._new_server(self.paths.dra, "dra")
                add_dra_services(self._dra_server, self._preparer)
                add_health_services(self._dra_server, self._health)
                self._bind(self._dra_server, self.paths.dra, "dra")
                self._reg_server = self._new_server(self.paths.registration, "registration")
                add_registration_service(self._reg_server, self._registration)
                self._bind(self._reg_server, self.paths.registration, "registration")
            except BaseException:
                self._stop_locked(grace=0)
                raise
            _log.info(
                "plugin %s waiting for the kubelet to register it via %s",
                self.driver_name,
                self.paths.registration,
            )

    def stop(self, grace: float = 5.0) -> None:
        with self._lock:
            self._stop_locked(grace)

    def _stop_locked(self, grace: float) -> None:
        for name, server, path in (
            ("registration", self._reg_server, self.paths.registration),
            ("dra", self._dra_server, self.paths.dra),
        ):
            if server is None:
                continue
            server.stop(grace).wait()
            _log.info("stopped %s server", name)
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self._reg_server = None
        self._dra_server = None
        self._health.stop()
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stop() has finished; True if it has."""
        return self._stopped.wait(timeout)
