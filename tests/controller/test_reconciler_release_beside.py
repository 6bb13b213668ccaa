"""Release writes beside the decision thread (`Reconciler(release_beside=...)`).

A pod that ended used to put its claim's two release writes in front of the next pod's
placement. Beside the decision thread they no longer do, and the model learns of each write
from the queue: until then the placement stays busy (invariant 4), never free too early.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from controller.objects import EventType, Kind, has_finalizer
from tests.support.engine_cluster import node
from tests.support.reconciler import ALLOCATION_FINALIZER, Harness, HeldWrites, claim, pod


class ThreadedWrites:
    """Release workers that run each write on a thread of its own after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.threads: list[threading.Thread] = []

    def offer(self, key: str, write: Callable[[], None]) -> bool:
        def later() -> None:
            time.sleep(self.delay)
            write()

        t = threading.Thread(target=later, daemon=True)
        t.start()
        self.threads.append(t)
        return True


def _one_slot_with_a_finished_pod(
    beside: HeldWrites | ThreadedWrites, release_wait: float = 0.01
) -> Harness:
    """Node n1 with one slot: pod p ran there and ended, pod q waits for the slot."""
    h = Harness(nodes={"n1": 1}, release_beside=beside.offer, release_wait=release_wait)
    h.add(Kind.NODE, node("n1"))  # a Ready node: a release, not a lost node's
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))
    h.step()
    assert h.current("c")["status"].get("allocation")
    assert not h.current("d")["status"].get("allocation")
    done = h.current("p")
    done["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, done)
    return h


def _a_finished_pod_then_a_new_one(
    beside: HeldWrites | ThreadedWrites, release_wait: float
) -> Harness:
    """Node n1 with one slot: pod p ran there and ended, and only then pod q arrives (the
    common case at a steady rate), never refused before; the next step places q."""
    h = Harness(nodes={"n1": 1}, release_beside=beside.offer, release_wait=release_wait)
    h.add(Kind.NODE, node("n1"))
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    done = h.current("p")
    done["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, done)
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))
    return h


def test_release_writes_run_beside_and_the_slot_stays_busy_until_they_land() -> None:
    beside = HeldWrites()
    h = _one_slot_with_a_finished_pod(beside)
    h.writer.calls.clear()
    h.step()
    assert [key for key, _ in beside.held] == ["ns/c"]
    assert h.writer.calls == []  # nothing written on the decision thread
    assert not h.current("d")["status"].get("allocation")  # c still counts as allocated
    h.step()
    assert len(beside.held) == 1  # in flight: not handed out twice

    beside.run_all()
    assert h.writer.calls == [("clear_allocation", "c")]  # one write: the claim stays
    assert not h.current("d")["status"].get("allocation")  # the model has not seen it yet
    h.step()  # the written claim arrives through the queue
    assert h.current("d")["status"]["allocation"]
    assert has_finalizer(h.current("c"), ALLOCATION_FINALIZER)  # kept for its next placement


def test_a_failed_release_write_is_retried() -> None:
    beside = HeldWrites()
    h = _one_slot_with_a_finished_pod(beside)
    h.writer.fail[("clear_allocation", "c")] = ConnectionError("apiserver unreachable")
    h.step()
    beside.run_all()
    assert h.current("c")["status"].get("allocation")
    h.step()  # the done marker makes the claim dirty again: a new attempt is handed beside
    beside.run_all()
    h.step()
    assert not h.current("c")["status"].get("allocation")
    assert h.current("d")["status"]["allocation"]


def test_writes_the_workers_cannot_take_run_inline() -> None:
    beside = HeldWrites(accept=False)
    h = _one_slot_with_a_finished_pod(beside)
    h.step()
    assert beside.held == []
    assert not h.current("c")["status"].get("allocation")
    assert h.current("d")["status"]["allocation"]  # freed and placed in one step, as before


def test_a_new_pod_waits_for_releases_in_flight_and_gets_the_freed_slot() -> None:
    beside = ThreadedWrites(delay=0.05)
    h = _a_finished_pod_then_a_new_one(beside, release_wait=5.0)
    h.step()  # hands c's release beside, then waits for it before placing q
    assert h.current("d")["status"]["allocation"]
    assert len(beside.threads) == 1


def test_a_pod_waiting_out_its_retry_does_not_hold_the_pass() -> None:
    beside = HeldWrites()  # never runs them on its own
    h = _one_slot_with_a_finished_pod(beside, release_wait=5.0)  # q was refused: retry later
    started = time.monotonic()
    h.step()
    assert time.monotonic() - started < 2.0
    assert len(beside.held) == 1


def test_the_wait_for_releases_is_bounded() -> None:
    beside = HeldWrites()  # never runs them on its own
    h = _a_finished_pod_then_a_new_one(beside, release_wait=0.2)
    started = time.monotonic()
    h.step()
    waited = time.monotonic() - started
    assert 0.2 <= waited < 2.0  # it did wait, and no longer than release_wait (plus a step)
    assert not h.current("d")["status"].get("allocation")


def test_a_deleted_claim_stays_gone_when_its_written_copy_arrives_after_the_deletion() -> None:
    """Dropping the last finalizer of a claim being deleted deletes it, and the write answers
    with the claim as it was, allocated. The watch may deliver the deletion before that answer
    reaches the queue: the late copy must not bring the claim back, holding its slot for good
    (the churn e2e test stalled on such ghosts)."""
    beside = HeldWrites()
    h = _one_slot_with_a_finished_pod(beside)
    deleting = h.current("c")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:09Z"
    h.update(Kind.CLAIM, deleting)
    h.step()
    assert [key for key, _ in beside.held] == ["ns/c"]
    gone = h.current("c")
    gone["metadata"]["finalizers"] = []
    h.rec.enqueue(Kind.CLAIM, EventType.DELETED, gone)  # the watch is first
    beside.run_all()
    assert h.writer.calls[-1] == ("remove_finalizer", "c")
    h.step()
    assert "ns/c" not in h.rec.stores[Kind.CLAIM]
    assert h.current("d")["status"]["allocation"]  # c's slot is free for q
