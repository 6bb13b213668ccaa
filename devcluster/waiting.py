"""Polling for a state the cluster reaches eventually, shared by the suites that drive it.

Test tooling: a probe returns the awaited value (anything truthy) or a falsy value while the
state is not there yet; running out of time is a test failure, so it raises AssertionError.

An Event, a condition or a status field written beside the change it reports (by another
writer, thread or process) is read through this too, never once right after the change:
`wait_for(what, read, until=predicate)` reads until the predicate holds and returns what it
read; on timeout the failure shows the last value read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, overload

T = TypeVar("T")

_SEEN_CHARS = 4000  # enough to show a pod's events or conditions, not a whole object list


@overload
def wait_for(
    what: str, probe: Callable[[], T | None], timeout: float = ..., interval: float = ...
) -> T: ...


@overload
def wait_for(
    what: str,
    probe: Callable[[], T],
    timeout: float = ...,
    interval: float = ...,
    *,
    until: Callable[[T], object],
) -> T: ...


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.1,
    *,
    until: Callable[[T], object] | None = None,
) -> T | None:
    """The probe's first truthy value, or with `until` the first value it accepts; the probe
    runs at least once, even with no time left."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value) if until is not None else value:  # type: ignore[arg-type]
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{_seen(value)}")
        time.sleep(interval)


def _seen(value: object) -> str:
    """The last value read, unless a bare False or None (a probe's own 'not yet')."""
    if value is None or value is False:
        return ""
    text = repr(value)
    if len(text) > _SEEN_CHARS:
        text = text[:_SEEN_CHARS] + f"... ({len(text)} chars)"
    return f"; last seen: {text}"
