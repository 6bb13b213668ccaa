"""A pool of writer threads: API writes run beside the decision thread, in order per object.

A placement needs three writes in order (claim finalizer, allocation, gate removal); the events
and the pod condition that tell the user about it are best effort by design (a failed one is
logged and never blocks a decision), yet written inline they were half of every placement's
round trips. Here they run on a few worker threads. Writes about one object go to one worker,
so they land in the order they were made (a "waits" condition never overtakes the "Placed"
one); a worker whose queue is full drops the write, counts it and logs it (`submit`).

Writes that must happen (a release's, a placement's: `Reconciler(release_beside=...,
commit_beside=...)`) use pools of their own through `offer`, which hands a full queue back to
the caller instead of dropping the write.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable

from controller.objects import Kind, key_of
from controller.seams import Recorder
from process.kube import Obj

Write = Callable[[], None]

_log = logging.getLogger(__name__)


class WritePool:
    """Worker threads, each with its own queue; a key always goes to the same worker."""

    def __init__(self, workers: int = 4, capacity: int = 10_000) -> None:
        self._queues: list[queue.Queue[Write | None]] = [
            queue.Queue(maxsize=capacity) for _ in range(workers)
        ]
        self.dropped = 0
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"write-pool-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: str, write: Write) -> None:
        """Run `write` later, after every write submitted earlier for the same key."""
        if not self.offer(key, write):
            self.dropped += 1
            _log.warning("dropped a best-effort write about %s", key)

    def offer(self, key: str, write: Write) -> bool:
        """Like `submit`, but a full queue is the caller's to handle: False, nothing queued
        (for writes that must happen, such as a release: the caller runs them itself)."""
        q = self._queues[zlib.crc32(key.encode()) % len(self._queues)]
        try:
            q.put_nowait(write)
        except queue.Full:
            return False
        return True

    def _run(self, q: queue.Queue[Write | None]) -> None:
        while True:
            write = q.get()
            if write is None:
                return
            try:
                write()
            except Exception:
                _log.exception("best-effort write failed")

    def pending(self) -> int:
        return sum(q.qsize() for q in self._queues)

    def drain(self, deadline: float) -> bool:
        """Take no more writes and wait until every write queued or in flight has ended, or
        `deadline` (`time.monotonic()`) passed; True when they all ended. A hand-over calls it
        with the write fence closed, so queued writes end at their first fence check instead
        of writing, and one in flight ends when its request does (each has a client
        timeout)."""
        for q in self._queues:
            try:
                q.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                continue
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def stop(self, timeout: float = 5.0) -> None:
        """Let queued writes finish for up to `timeout`, then leave the rest."""
        self.drain(time.monotonic() + timeout)


class DeferredRecorder:
    """A `Recorder` whose events are written by a `WritePool`, in order per object."""

    def __init__(self, recorder: Recorder, pool: WritePool) -> None:
        self._recorder = recorder
        self._pool = pool

    def event(self, obj: Obj, kind: Kind, type_: str, reason: str, message: str) -> None:
        def write() -> None:
            self._recorder.event(obj, kind, type_, reason, message)

        self._pool.submit(key_of(obj), write)
