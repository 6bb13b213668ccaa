"""Polling for a state the cluster reaches eventually, shared by the suites that drive it.

Test tooling: a probe returns the awaited value (anything truthy) or a falsy value while the
state is not there yet; running out of time is a test failure, so it raises AssertionError.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.1
) -> T:
    """The probe's first truthy value; the probe runs at least once, even with no time left."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
