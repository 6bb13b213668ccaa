"""Whether the decision loop makes progress: the controller's liveness (issue 41.6).

Every pass of the loop in `controller.main` beats; a pass that has not ended for
`DECISION_STALL_S` means the loop is wedged (a deadlock, a call that never returns), and the
process can no longer place anything although it answers HTTP. Then /healthz fails, so the
kubelet restarts the controller, and the leader elector stops renewing, so a standby takes over
as soon as the lease expires instead of waiting for the restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DECISION_STALL_S = 60.0
"""Far above the longest pass measured (a resync at 1,000 GPU nodes takes a few seconds,
docs/scale.md), well below what an operator would call an outage."""


class LoopLiveness:
    """The loop's heartbeat; `check` is "" while it beats, else why the loop is stuck."""

    def __init__(
        self, *, stall_s: float = DECISION_STALL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stall_s = stall_s
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()

    def beat(self) -> None:
        with self._lock:
            self._last = self._clock()

    def check(self) -> str:
        with self._lock:
            quiet = self._clock() - self._last
        if quiet < self._stall_s:
            return ""
        return (
            f"the decision loop has made no progress for {quiet:.0f}s (limit "
            f"{self._stall_s:.0f}s): it is stuck, and places nothing"
        )
