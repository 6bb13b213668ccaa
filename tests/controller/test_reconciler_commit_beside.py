"""Placement writes beside the decision thread (`Reconciler(commit_beside=...)`).

A placement is three writes in a row (finalizer, allocation, gate). Beside the decision
thread, the reconciler assumes the allocation in its store and model and goes on to the next
pod; these tests hold the writes back to show that an assumed placement is never handed out
twice, that a failed commit frees it again and tells the user, and that nothing leaks when
the pod or the claim goes away meanwhile.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest

from controller.objects import EventType, Kind, has_finalizer
from controller.writepool import WritePool
from process.kube import Obj
from tests.support.engine_cluster import node
from tests.support.reconciler import (
    ALLOCATION_FINALIZER,
    SCHEDULING_GATE,
    Harness,
    HeldWrites,
    MemoryWriter,
    claim,
    pod,
)


def _harness(
    nodes: dict[str, int], beside: HeldWrites | WritePool, writer: MemoryWriter | None = None
) -> Harness:
    """Ready nodes with `nodes[name]` interchangeable slots; commits go to `beside`."""
    h = Harness(nodes=nodes, commit_beside=beside.offer, writer=writer)
    for name in nodes:
        h.add(Kind.NODE, node(name))  # Ready: a node the controller does not take for lost
    return h


def _gated(h: Harness, name: str) -> bool:
    gates = h.current(name)["spec"].get("schedulingGates") or []
    return any(g["name"] == SCHEDULING_GATE for g in gates)


def _reasons(h: Harness, name: str) -> list[str]:
    return [reason for obj, _, reason, _ in h.recorder.events if obj == name]


def _two_pods(h: Harness) -> None:
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))


def test_a_commit_in_flight_holds_its_placement_and_lands_through_the_queue() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    _two_pods(h)
    h.step()
    assert [key for key, _ in beside.held] == ["ns/p"]
    assert h.writer.calls == []  # nothing written on the decision thread
    # q waits: the one slot is p's while p's writes are in flight.
    assert "NoCapacity" in _reasons(h, "q")
    assert h.planner.used() == {("n1", "dev-0")}
    h.step()
    assert len(beside.held) == 1  # in flight: not placed twice

    beside.run_all()
    assert h.writer.calls == [
        ("add_finalizer", "c"),
        ("write_allocation", "c"),
        ("remove_gate", "p"),
    ]
    h.step()  # the commit's end arrives through the queue
    assert (
        h.rec.stores[Kind.CLAIM]["ns/c"]["metadata"]["resourceVersion"]
        == (h.current("c")["metadata"]["resourceVersion"])
    )
    assert not _gated(h, "p")
    assert "Placed" in _reasons(h, "p")
    assert _reasons(h, "c") == [], "a placement is told on the pod only"
    assert h.planner.committed_pods == ["p"]
    assert h.allocated_devices() == [("n1", "dev-0")]
    assert not h.current("d")["status"].get("allocation")


def test_pods_on_free_placements_are_decided_without_waiting_for_the_writes() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 2}, beside)
    _two_pods(h)
    h.step()
    assert [key for key, _ in beside.held] == ["ns/p", "ns/q"]  # both in one pass
    beside.run_all()
    h.step()
    devices = sorted(h.allocated_devices())
    assert devices == [("n1", "dev-0"), ("n1", "dev-1")]
    assert not _gated(h, "p") and not _gated(h, "q")


def test_a_pod_sharing_a_claim_being_committed_is_ungated_only_once_it_is_written() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("shared"))
    h.add(Kind.POD, pod("p", ["shared"]))
    h.add(Kind.POD, pod("q", ["shared"], created="2026-01-02T00:00:00Z"))
    h.step()
    h.now[0] += 60  # past q's retry
    h.step()  # q's claim now looks allocated in the store, but is only assumed so
    assert [key for key, _ in beside.held] == ["ns/p"]
    assert _gated(h, "q")  # ungated now, kube-scheduler would find its claim unallocated
    beside.run_all()
    h.step()
    assert not _gated(h, "p")
    assert not _gated(h, "q")
    assert h.allocated_devices() == [("n1", "dev-0")]


def test_the_informers_copy_with_only_the_finalizer_does_not_free_the_assumed_slot() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    # The watch delivers the first write (the finalizer) before the allocation lands.
    halfway = h.current("c")
    halfway["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    h.update(Kind.CLAIM, halfway)
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))
    h.step()
    assert h.planner.used() == {("n1", "dev-0")}
    assert h.rec.stores[Kind.CLAIM]["ns/c"]["status"].get("allocation")
    assert [key for key, _ in beside.held] == ["ns/p"]
    assert "NoCapacity" in _reasons(h, "q")


@pytest.mark.parametrize("failing", ["add_finalizer", "write_allocation"])
def test_a_failed_commit_frees_its_placement_tells_the_pod_and_is_placed_again(
    failing: str,
) -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.writer.fail[(failing, "c")] = ConnectionError("apiserver unreachable")
    h.step()
    beside.run_all()
    h.step()
    # The write may have landed: the placement stays held until a fresh read says it did not.
    assert h.planner.used() == {("n1", "dev-0")}
    assert [key for key, _ in beside.held] == ["ns/c"]  # that read, beside
    beside.run_all()
    h.step()
    assert h.planner.used() == set()  # the assumed allocation is gone from the model
    stored = h.rec.stores[Kind.CLAIM]["ns/c"]
    assert not stored["status"].get("allocation")
    # The store holds what the apiserver has: the finalizer only if its write went through.
    assert has_finalizer(stored, ALLOCATION_FINALIZER) == (failing == "write_allocation")
    assert h.planner.committed_pods == []
    assert "PlacementWriteFailed" in _reasons(h, "p")
    assert _gated(h, "p")

    h.now[0] += 60  # past the backoff
    h.step()
    assert [key for key, _ in beside.held] == ["ns/p"]
    beside.run_all()
    h.step()
    assert h.current("c")["status"]["allocation"]
    assert not _gated(h, "p")
    assert h.planner.committed_pods == ["p"]


def test_a_second_claim_that_fails_rolls_the_first_back() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 2}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.CLAIM, claim("e"))
    h.add(Kind.POD, pod("p", ["c", "e"]))
    h.writer.fail[("write_allocation", "e")] = ConnectionError("apiserver unreachable")
    h.step()
    beside.run_all()
    assert ("clear_allocation", "c") in h.writer.calls
    h.step()
    assert h.allocated_devices() == []
    # e's allocation may have landed, so both stay held until fresh reads say otherwise.
    assert len(h.planner.used()) == 2
    beside.run_all()
    h.step()
    assert sorted(h.writer.reads) == ["c", "e"]
    assert h.planner.used() == set()
    assert _gated(h, "p")


def test_a_gate_that_cannot_be_removed_keeps_the_allocation_and_is_ungated_later() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.writer.fail[("remove_gate", "p")] = ConnectionError("apiserver unreachable")
    h.step()
    beside.run_all()
    h.step()
    assert h.current("c")["status"]["allocation"]
    assert h.planner.committed_pods == ["p"]
    assert "PlacementWriteFailed" in _reasons(h, "p")
    assert _gated(h, "p")
    h.now[0] += 60
    h.step()  # all its claims are allocated: only the gate is left to remove, inline
    assert not _gated(h, "p")
    assert h.allocated_devices() == [("n1", "dev-0")]


def test_a_pod_deleted_during_its_commit_has_its_claim_released_after_it() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    h.rec.enqueue(Kind.POD, EventType.DELETED, h.current("p"))
    h.step()
    assert ("clear_allocation", "c") not in h.writer.calls  # nothing released mid-commit
    beside.run_all()
    h.step()
    assert not h.current("c")["status"].get("allocation")
    # The claim stays (nobody deleted it): it keeps the finalizer for its next placement.
    assert has_finalizer(h.current("c"), ALLOCATION_FINALIZER)
    assert h.planner.used() == set()


def test_a_claim_deleted_during_its_commit_stays_gone() -> None:
    beside = HeldWrites()
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    h.rec.enqueue(Kind.CLAIM, EventType.DELETED, h.current("c"))
    h.step()
    assert "ns/c" not in h.rec.stores[Kind.CLAIM]
    assert h.planner.used() == set()
    beside.run_all()  # the writes' answers arrive after the deletion
    h.step()
    assert "ns/c" not in h.rec.stores[Kind.CLAIM]
    assert h.planner.used() == set()


def test_commits_the_workers_cannot_take_run_inline() -> None:
    beside = HeldWrites(accept=False)
    h = _harness({"n1": 1}, beside)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert beside.held == []
    assert h.current("c")["status"]["allocation"]
    assert not _gated(h, "p")
    assert h.planner.committed_pods == ["p"]


class _LockedWriter(MemoryWriter):
    """The memory writer, safe to call from several worker threads at once."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()

    def put(self, obj: Obj) -> Obj:
        with self._lock:
            return super().put(obj)

    def _call(self, op: str, obj: Obj) -> Obj:
        with self._lock:
            if random.random() < 0.1:  # one write in ten fails
                self.fail[(op, obj["metadata"]["name"])] = ConnectionError("flaky")
            return super()._call(op, obj)


def test_under_parallel_commits_with_failures_no_device_is_given_twice() -> None:
    random.seed(7)
    workers = WritePool(workers=4)
    h = _harness({"n1": 6, "n2": 6}, workers, writer=_LockedWriter())
    for i in range(20):
        h.add(Kind.CLAIM, claim(f"c{i}"))
        h.add(Kind.POD, pod(f"p{i}", [f"c{i}"], created=f"2026-01-01T00:00:{i:02d}Z"))
    for _ in range(400):
        h.now[0] += 1.0
        h.rec.step(timeout=0.01)
        devices = h.allocated_devices()
        assert len(devices) == len(set(devices)), "a device was allocated twice"
        model = sorted(h.planner.used())
        assert len(model) <= 12
        if len(devices) == 12 and workers.pending() == 0 and not h.rec._committer.any_in_flight:
            break
    workers.stop()
    devices = h.allocated_devices()
    assert len(devices) == 12 == len(set(devices))
    stored = [
        copy.deepcopy(c)
        for c in h.rec.stores[Kind.CLAIM].values()
        if c.get("status", {}).get("allocation")
    ]
    assert len(stored) == 12
    ungated = [n for n in (f"p{i}" for i in range(20)) if not _gated(h, n)]
    assert len(ungated) == 12
