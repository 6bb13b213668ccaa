"""The DRAResourceHealth gRPC services (v1alpha1 and v1): stream device health to the kubelet.

The kubelet treats each message as the complete health list of this driver on the node and marks
a device Unknown when it has not been reported within `health_check_timeout_seconds`. So every
message carries every device, a message goes out whenever the list changes, and the full list is
re-sent periodically even when nothing changed, well inside the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import grpc

from kubeletplugin._generated import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
)

_log = logging.getLogger(__name__)


class DeviceHealthReport(NamedTuple):
    """Health of one published device; a plain tuple (pool, device, healthy, message) works too."""

    pool: str
    device: str
    healthy: bool
    message: str


HealthSource = Callable[[], Sequence[tuple[str, str, bool, str]]]
"""Returns the current health of every device this plugin publishes."""


class HealthBroadcaster:
    """Polls a HealthSource and wakes every open stream when the list changes or is due again.

    One poller per plugin rather than one per stream, so a misbehaving kubelet that opens many
    streams cannot multiply the cost of health checks.
    """

    def __init__(
        self,
        source: HealthSource,
        *,
        poll_interval: float = 5.0,
        resend_interval: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if poll_interval <= 0 or resend_interval <= 0:
            raise ValueError("health poll and resend intervals must be positive")
        self._source = source
        self._poll_interval = poll_interval
        self._resend_interval = resend_interval
        self._clock = clock
        self._cond = threading.Condition()
        self._snapshot: tuple[DeviceHealthReport, ...] = ()
        self._checked_at = 0
        self._version = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def timeout_seconds(self) -> int:
        """What the kubelet may wait before distrusting an entry: three missed resends."""
        return max(30, int(3 * self._resend_interval))

    def start(self) -> None:
        with self._cond:
            self._stopped = False
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def refresh(self) -> None:
        """Read the source now; callers that learn of a change can push it without waiting."""
        try:
            reports = tuple(DeviceHealthReport(*entry) for entry in self._source())
        except Exception:
            # Keep the last good list: silence would let the kubelet time the devices out to
            # Unknown, which is the honest outcome if the source stays broken.
            _log.exception("device health source failed; keeping the previous health list")
            return
        with self._cond:
            self._checked_at = int(self._clock())
            if reports != self._snapshot:
                _log.info(
                    "device health changed: %d device(s), %d unhealthy",
                    len(reports),
                    sum(1 for r in reports if not r.healthy),
                )
                self._snapshot = reports
                self._version += 1
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._stopped, timeout=self._poll_interval):
                    return
            self.refresh()

    def watch(
        self, is_active: Callable[[], bool]
    ) -> Iterator[tuple[int, Sequence[DeviceHealthReport]]]:
        """Yield (checked_at, full list) now, on every change and at least every resend interval."""
        seen = -1

        def due() -> bool:
            return self._stopped or self._version != seen or not is_active()

        while True:
            with self._cond:
                self._cond.wait_for(due, timeout=self._resend_interval if seen >= 0 else 0)
                if self._stopped or not is_active():
                    return
                seen = self._version
                snapshot, checked_at = self._snapshot, self._checked_at
            yield checked_at, snapshot

    def wake(self) -> None:
        """Let waiting streams re-check whether their RPC is still active."""
        with self._cond:
            self._cond.notify_all()


def _stream(
    broadcaster: HealthBroadcaster,
    context: grpc.ServicerContext,
    build: Callable[[int, Sequence[DeviceHealthReport], int], object],
    api: str,
) -> Iterator[object]:
    context.add_callback(broadcaster.wake)
    _log.info("kubelet opened a %s device-health stream", api)
    for checked_at, snapshot in broadcaster.watch(context.is_active):
        yield build(checked_at, snapshot, broadcaster.timeout_seconds)
    _log.info("%s device-health stream closed", api)


def _v1alpha1_message(
    checked_at: int, reports: Sequence[DeviceHealthReport], timeout: int
) -> dra_health_v1alpha1_pb2.NodeWatchResourcesResponse:
    msg = dra_health_v1alpha1_pb2.NodeWatchResourcesResponse()
    for report in reports:
        msg.devices.add(
            device=dra_health_v1alpha1_pb2.DeviceIdentifier(
                pool_name=report.pool, device_name=report.device
            ),
            health=dra_health_v1alpha1_pb2.HEALTHY
            if report.healthy
            else dra_health_v1alpha1_pb2.UNHEALTHY,
            last_updated_time=checked_at,
            health_check_timeout_seconds=timeout,
            message=report.message,
        )
    return msg


def _v1_message(
    checked_at: int, reports: Sequence[DeviceHealthReport], timeout: int
) -> dra_health_v1_pb2.NodeWatchResourcesResponse:
    msg = dra_health_v1_pb2.NodeWatchResourcesResponse()
    for report in reports:
        msg.devices.add(
            device=dra_health_v1_pb2.DeviceIdentifier(
                pool_name=report.pool, device_name=report.device
            ),
            health=dra_health_v1_pb2.HEALTHY if report.healthy else dra_health_v1_pb2.UNHEALTHY,
            last_updated_time=checked_at,
            health_check_timeout_seconds=timeout,
            message=report.message,
        )
    return msg


class ResourceHealthV1alpha1(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    """`v1alpha1.DRAResourceHealth`, the version 1.35-1.36 kubelets call."""

    def __init__(self, broadcaster: HealthBroadcaster) -> None:
        self._broadcaster = broadcaster

    def NodeWatchResources(  # noqa: N802 (gRPC method name)
        self,
        request: dra_health_v1alpha1_pb2.NodeWatchResourcesRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[object]:
        return _stream(self._broadcaster, context, _v1alpha1_message, "v1alpha1")


class ResourceHealthV1(dra_health_v1_pb2_grpc.DRAResourceHealthServicer):
    """`v1.DRAResourceHealth`, which supersedes v1alpha1 from Kubernetes 1.37."""

    def __init__(self, broadcaster: HealthBroadcaster) -> None:
        self._broadcaster = broadcaster

    def NodeWatchResources(  # noqa: N802 (gRPC method name)
        self, request: dra_health_v1_pb2.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[object]:
        return _stream(self._broadcaster, context, _v1_message, "v1")


def add_health_services(server: grpc.Server, broadcaster: HealthBroadcaster) -> None:
    """Serve both DRAResourceHealth versions from one broadcaster on `server`."""
    # The generated registration helpers carry no annotations (grpcio-tools emits no .pyi).
    add_v1alpha1 = dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server
    add_v1 = dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server
    add_v1alpha1(ResourceHealthV1alpha1(broadcaster), server)  # type: ignore[no-untyped-call]
    add_v1(ResourceHealthV1(broadcaster), server)  # type: ignore[no-untyped-call]
