"""One allocator for carve's claims (issue 30.4), the controller's half.

The chart's carve-sole-allocator policy refuses kube-scheduler's allocation of a claim of
carve's classes unless carve handed it over; so a pod that escaped the gate (its template not
yet in the gate policy's cache, a namespace outside the policy's selector) must be placed by
carve, ungated, and a pod carve hands over must carry the mark that lets kube-scheduler in.
The policies themselves are tested with real tokens in tests/deploy/test_least_privilege.py
and end to end in tests/e2e/test_two_allocators.py.
"""

from __future__ import annotations

import copy

from controller.objects import CarveClasses, Kind, handed_to_scheduler, has_finalizer, has_gate
from controller.work import WorkKind, pod_work
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER
from tests.support.reconciler import (
    ALLOCATION_FINALIZER,
    SCHEDULING_GATE,
    Harness,
    claim,
    pod,
)

KUEUE_GATE = "kueue.x-k8s.io/admission"


def test_an_ungated_pod_with_a_carve_claim_nobody_allocated_is_carves_to_place() -> None:
    c = claim("c")
    escaped = pod("p", ["c"], gated=False)
    assert pod_work(escaped, {"ns/c": c}, CarveClasses()).kind is WorkKind.PLACE
    # Not while a queue's gate holds it: it is not schedulable yet.
    held = copy.deepcopy(escaped)
    held["spec"]["schedulingGates"] = [{"name": KUEUE_GATE}]
    assert pod_work(held, {"ns/c": c}, CarveClasses()).kind is WorkKind.NONE
    # Not once carve handed the claim to kube-scheduler.
    handed = copy.deepcopy(c)
    handed["metadata"]["annotations"] = {DEFAULT_CONTRACT.allocator_annotation: HANDED_TO_SCHEDULER}
    assert pod_work(escaped, {"ns/c": handed}, CarveClasses()).kind is WorkKind.NONE
    # Nor a claim of a class that is not carve's (kube-scheduler's, the native path).
    foreign = claim("f", cls="other.example.com")
    assert pod_work(pod("q", ["f"], gated=False), {"ns/f": foreign}, CarveClasses()).kind is (
        WorkKind.NONE
    )


def test_an_escaped_pod_is_placed_ungated_and_told_why() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"], gated=False))
    h.step()
    assert h.writer.calls == [("add_finalizer", "c"), ("write_allocation", "c")]
    assert h.allocated_devices() == [("n1", "dev-0")]
    reasons = [(name, reason) for name, _, reason, _ in h.recorder.events]
    assert ("p", "PlacingUngated") in reasons
    assert ("p", "Placed") in reasons
    assert ("p", "AllocationCleared") not in reasons  # nothing of carve's was cleared


def test_an_escaped_pod_whose_claim_has_the_finalizer_from_creation_is_placed_ungated() -> None:
    """carve's admission policy puts the finalizer on the claim at creation, so the finalizer
    does not say carve ever allocated it: this is an escape, not kube-scheduler's clearing."""
    h = Harness(nodes={"n1": 1})
    c = claim("c")
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    h.add(Kind.CLAIM, c)
    h.add(Kind.POD, pod("p", ["c"], gated=False))
    h.step()
    assert h.writer.calls == [("write_allocation", "c")]
    reasons = [(name, reason) for name, _, reason, _ in h.recorder.events]
    assert ("p", "PlacingUngated") in reasons
    assert ("p", "AllocationCleared") not in reasons


def test_native_fallback_marks_every_unallocated_carve_claim_handed_over() -> None:
    h = Harness(nodes={"n1": 0}, native_fallback_after=30.0)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.CLAIM, claim("f", cls="other.example.com"))
    h.add(Kind.POD, pod("p", ["c", "f"], created="2026-01-01T00:00:00Z"))
    h.step()
    h.now[0] += 60
    h.wall[0] = h.wall[0].replace(minute=5)
    h.step()
    c = h.current("c")
    assert not has_gate(h.current("p"), SCHEDULING_GATE)
    assert handed_to_scheduler(c, DEFAULT_CONTRACT)
    assert not has_finalizer(c, ALLOCATION_FINALIZER)
    assert "annotations" not in h.current("f")["metadata"]  # not carve's: untouched
    # Handed over: carve never places it again, though it is ungated and unallocated.
    calls = len(h.writer.calls)
    h.now[0] += 600
    h.step()
    assert len(h.writer.calls) == calls
