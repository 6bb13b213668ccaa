"""Best-effort writes beside the decision thread (controller/writepool.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

from controller.objects import Kind
from controller.writepool import DeferredRecorder, WritePool
from devcluster.waiting import wait_for


def test_writes_about_one_object_land_in_order() -> None:
    side = WritePool(workers=3)
    seen: dict[str, list[int]] = {}
    lock = threading.Lock()

    def write(key: str, i: int) -> None:
        time.sleep(0.001 * (i % 3))
        with lock:
            seen.setdefault(key, []).append(i)

    for i in range(30):
        for key in ("ns/a", "ns/b", "ns/c"):
            side.submit(key, lambda k=key, n=i: write(k, n))
    wait_for(
        "all 90 side writes to run",
        lambda: side.pending() == 0 and sum(len(v) for v in seen.values()) == 90,
        timeout=10,
        interval=0.01,
    )
    side.stop()
    assert seen == {k: list(range(30)) for k in ("ns/a", "ns/b", "ns/c")}


def test_a_failing_write_neither_stops_the_worker_nor_escapes() -> None:
    side = WritePool(workers=1)
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("apiserver said no")

    side.submit("k", boom)
    side.submit("k", lambda: done.append("after"))
    wait_for(
        "the write after the failing one",
        lambda: done,
        until=lambda d: d == ["after"],
        timeout=10,
        interval=0.01,
    )
    side.stop()


def test_a_full_queue_drops_and_counts() -> None:
    side = WritePool(workers=1, capacity=2)
    gate = threading.Event()
    side.submit("k", gate.wait)  # occupies the worker
    wait_for("the worker to take the held write", lambda: side.pending() == 0, 10, 0.01)
    for _ in range(5):
        side.submit("k", lambda: None)
    assert side.dropped == 3
    gate.set()
    side.stop()


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, obj: dict[str, Any], kind: Kind, type_: str, reason: str, message: str) -> None:
        self.events.append((obj["metadata"]["name"], reason))


def test_deferred_recorder_writes_through_the_side_writer() -> None:
    inner = _Recorder()
    side = WritePool(workers=2)
    rec = DeferredRecorder(inner, side)
    pod = {"metadata": {"name": "p", "namespace": "ns"}}
    rec.event(pod, Kind.POD, "Normal", "Placed", "on n1")
    rec.event(pod, Kind.POD, "Warning", "Later", "x")
    wait_for(
        "both events written",
        lambda: inner.events,
        until=lambda events: len(events) == 2,
        timeout=10,
        interval=0.01,
    )
    side.stop()
    assert inner.events == [("p", "Placed"), ("p", "Later")]
