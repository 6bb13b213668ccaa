"""The start-up's pieces without a process: its readiness check and its wait for the apiserver."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubeletplugin.startup import StartupProgress, wait_for_apiserver


class _Api:
    """Fails `failures` times, then answers; records each call's timeout."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.timeouts: list[float | None] = []

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        self.timeouts.append(kw.get("timeout"))
        if len(self.timeouts) <= self.failures:
            raise ConnectionError(f"refused #{len(self.timeouts)}")
        return {}


def test_the_check_names_the_phase_until_start_up_is_done() -> None:
    progress = StartupProgress()
    progress.phase("reconciling the checkpoint with NVML")
    assert progress.check() == "start-up is reconciling the checkpoint with NVML"
    progress.finish()
    assert progress.check() == "" and progress.done.is_set()


def test_the_wait_retries_with_the_clients_timeout_until_the_apiserver_answers() -> None:
    api, heard = _Api(failures=2), []
    assert wait_for_apiserver(api, threading.Event(), heard.append, within=30, max_backoff=0.01)
    assert api.timeouts == [None, None, None]  # the client's own: slow is not down
    assert heard == ["refused #1", "refused #2"]


def test_the_wait_gives_up_after_its_time_and_at_once_when_stopped() -> None:
    api = _Api(failures=10**6)
    started = time.monotonic()
    assert not wait_for_apiserver(api, threading.Event(), lambda _: None, within=0.3,
                                  max_backoff=0.05)  # fmt: skip
    assert 0.3 <= time.monotonic() - started < 5
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    assert not wait_for_apiserver(api, stop, lambda _: None, within=600)  # backoff up to 30 s
    assert time.monotonic() - started < 5
