"""What the controller writes, request by request: on a placement, on a wait, on a refusal,
on a release (issue 29). Every write is one request the controller's single process makes,
so the sequence is pinned: a new write must be a decision, not an accident.

A placement is told as kube-scheduler tells a binding, with one event on the pod; a wait and a
refusal keep everything a user needs to see why (event on the pod and its claims, condition).
"""

from __future__ import annotations

from typing import Any

from controller.objects import EventType, Kind, Unplaceable
from tests.support.reconciler import ALLOCATION_FINALIZER, Harness, claim, pod

_READY = {"conditions": [{"type": "Ready", "status": "True"}]}


def _writes(h: Harness) -> list[str]:
    """Every request in order: the writer's calls, the conditions and the events."""
    return [op for op, _ in h.writer.calls]


def _ours(name: str) -> Any:
    c = claim(name)
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]  # as carve's admission policy adds it
    return c


def test_a_placement_writes_the_allocation_the_gate_and_one_pod_event() -> None:
    h = Harness()
    h.add(Kind.CLAIM, _ours("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert _writes(h) == ["write_allocation", "remove_gate"]
    assert [(e[0], e[2]) for e in h.recorder.events] == [("p", "Placed")], "no claim event"
    assert h.writer.conditions == {}, "no condition where no wait set one"


def test_a_claim_created_before_the_policy_gets_the_finalizer_first() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert _writes(h) == ["add_finalizer", "write_allocation", "remove_gate"]


def test_a_wait_is_told_on_the_pod_its_claims_and_the_condition() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, _ours("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.add(Kind.CLAIM, _ours("big"))
    h.update(Kind.CLAIM, {**h.current("big"), "spec": claim("big", count=2)["spec"]})
    h.add(Kind.POD, pod("q", ["big"], created="2026-01-01T00:00:05Z"))
    h.step()
    assert [e[:3] for e in h.recorder.events if e[0] != "p"] == [
        ("q", "Warning", "NoCapacity"),
        ("big", "Warning", "NoCapacity"),
    ]
    assert h.writer.conditions["q"][:2] == (False, "NoCapacity")
    assert ("write_allocation", "big") not in h.writer.calls


def test_a_refusal_is_told_on_the_pod_its_claims_and_the_condition() -> None:
    h = Harness()
    h.planner.verdict = Unplaceable("UnknownProfile", "no GPU has 9g.99gb", permanent=True)
    h.add(Kind.CLAIM, _ours("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert _writes(h) == []
    assert [e[:3] for e in h.recorder.events] == [
        ("p", "Warning", "UnknownProfile"),
        ("c", "Warning", "UnknownProfile"),
    ]
    assert h.writer.conditions["p"] == (False, "UnknownProfile", "no GPU has 9g.99gb")


def test_a_pod_that_waited_gets_its_condition_turned_true_when_placed() -> None:
    h = Harness()
    h.planner.verdict = Unplaceable("NoCapacity", "full")
    h.add(Kind.CLAIM, _ours("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    h.planner.verdict = None
    h.now[0] += 60  # the retry is due
    h.step()
    assert h.writer.conditions["p"][:2] == (True, "Placed")
    assert [e[2] for e in h.recorder.events if e[0] == "p"] == ["NoCapacity", "Placed"]


def test_a_release_is_one_write_and_no_event() -> None:
    h = Harness()
    h.add(Kind.NODE, {"metadata": {"name": "n1", "uid": "n1"}, "status": _READY})
    h.add(Kind.CLAIM, _ours("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    h.writer.calls.clear()
    h.recorder.events.clear()
    placed = h.current("p")
    h.rec.enqueue(Kind.POD, EventType.DELETED, placed)
    h.step()
    assert _writes(h) == ["clear_allocation"], "the claim stays: its finalizer stays too"
    h.writer.calls.clear()
    gone = h.current("c")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    h.update(Kind.CLAIM, gone)
    h.step()
    assert _writes(h) == ["remove_finalizer"], "a claim being deleted loses only its finalizer"
    assert h.recorder.events == []


def test_a_claim_from_a_template_is_released_by_its_deletion_alone() -> None:
    """kube-controller-manager deletes a pod's generated claim once the pod is gone: clearing
    its allocation first would be a write racing kube-controller-manager's (a 409, a GET)."""
    h = Harness()
    h.add(Kind.NODE, {"metadata": {"name": "n1", "uid": "n1"}, "status": _READY})
    p = pod("p", ["p-gpu"])
    generated = _ours("p-gpu")
    generated["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "p",
            "uid": p["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    h.add(Kind.CLAIM, generated)
    h.add(Kind.POD, p)
    h.step()
    h.writer.calls.clear()
    h.rec.enqueue(Kind.POD, EventType.DELETED, h.current("p"))
    h.step()
    assert _writes(h) == [], "the allocation stays until the claim is deleted"
    gone = h.current("p-gpu")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    h.update(Kind.CLAIM, gone)
    h.step()
    assert _writes(h) == ["remove_finalizer"]
    assert ALLOCATION_FINALIZER not in h.current("p-gpu")["metadata"]["finalizers"]
