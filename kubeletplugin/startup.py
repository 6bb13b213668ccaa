"""What the node agent's start-up is doing, for /readyz, and its waits on the apiserver.

Start-up used to run before /healthz existed, and its API calls (a claim read per prepared
claim, a finalizer removal per interrupted claim, events) each cost up to four client timeouts
against a slow apiserver: the kubelet's liveness probe killed the agent before it served
(NVIDIA's DRA driver had the same bug, its issues 773 and 774). Now the ops endpoints come
first, start-up runs behind them, and `StartupProgress` is its `startup` readiness check: the
phase it is in, until it is done.

The phases and what each waits for are in docs/kubeletplugin.md ("Start-up and shutdown").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential,
)

from process.kube.jsonclient import JsonRequests

if TYPE_CHECKING:
    from kubeletplugin.metrics import PluginMetrics
    from process.opshttp import OpsServer

log = logging.getLogger(__name__)

RECONCILE_API_SECONDS = 10.0
"""What the start-up reconcile (which registration waits for) gives the apiserver in all: its
API calls are side matters (a finalizer to remove, an event), each left to housekeeping when
they fail, so a slow apiserver must not hold the kubelet's registration back for long."""

READYZ_API_TIMEOUT = 4.0
"""Seconds for /readyz's `GET /version` (tried twice): within the chart's readiness probe
timeout, and room for an apiserver that is slow but answers. Start-up's wait for the
apiserver takes the client's own timeout instead: an apiserver that answers in 5 s is slow,
not down, and claim reads work against it."""

API_WAIT_MAX_BACKOFF = 30.0
"""The longest pause between two tries of the apiserver while start-up waits for it."""


class StartupProgress:
    """The phase start-up is in, as its readiness check reports it; thread-safe."""

    def __init__(self, phase: str = "starting") -> None:
        self._lock = threading.Lock()
        self._phase = phase
        self.done = threading.Event()

    def phase(self, text: str) -> None:
        """Enter a phase (logged, and shown in /readyz until the next one)."""
        with self._lock:
            self._phase = text
        log.info("start-up: %s", text)

    def finish(self) -> None:
        with self._lock:
            self._phase = ""
        self.done.set()
        log.info("start-up done")

    def check(self) -> str:
        """The `startup` readiness check: "" once done, else what it is still doing."""
        with self._lock:
            return f"start-up is {self._phase}" if self._phase else ""


def wait_for_apiserver(
    api: JsonRequests,
    stop: threading.Event,
    on_failure: Callable[[str], None],
    *,
    within: float,
    max_backoff: float = API_WAIT_MAX_BACKOFF,
) -> bool:
    """Whether the apiserver answered `GET /version` before `within` seconds passed or
    `stop` was set.

    Each try has the client's timeout; between tries the pause doubles from 1 s up to
    `max_backoff`, spent waiting on `stop` so that a SIGTERM ends the wait at once.
    `on_failure` hears each failed try's error (start-up shows it in /readyz)."""

    def probe() -> None:
        api.request("GET", "/version")

    def failed(state: object) -> None:
        outcome = getattr(state, "outcome", None)
        error = outcome.exception() if outcome is not None else None
        on_failure(str(error))

    def pause(seconds: float) -> None:
        stop.wait(seconds)

    retrying = Retrying(
        retry=retry_if_exception_type(Exception),
        wait=wait_exponential(multiplier=1, max=max_backoff),
        stop=stop_after_delay(within) | stop_when_event_set(stop),
        sleep=pause,
        before_sleep=failed,
        reraise=True,
    )
    try:
        retrying(probe)
    except Exception:
        return False  # out of time or stopped: every other failure was retried
    return True


def early_ops(address: str, metrics: PluginMetrics, startup: StartupProgress) -> OpsServer:
    """The ops server with only the `startup` check: what the process serves before it has
    opened NVML or read its checkpoint (NodePlugin hands it the full set when assembled)."""
    from process.opshttp import OpsServer

    return OpsServer(address, metrics.registry, {"startup": startup.check})
