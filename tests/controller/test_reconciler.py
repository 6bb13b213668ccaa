"""Reconciler state machine: queue order, all-or-nothing commits, release handshake, fallback.

The placement engine is replaced by a deliberately trivial planner (first free device on the
first node that fits all requests) so that these tests exercise only the reconciler's logic.
The writer is an in-memory object store with resourceVersions (both in
tests/support/reconciler.py); `KubeClaimWriter` itself is tested in test_status.py and against
the real apiserver in tests/controller/cluster/.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.objects import (
    CarveClasses,
    EventType,
    Kind,
    Unplaceable,
    has_finalizer,
    has_gate,
    priority_key,
)
from controller.reconciler import Reconciler
from controller.release import ReleaseKind, release_action
from controller.status import WriteSkippedError
from controller.work import WorkKind, pod_work
from driver.contract import DEFAULT_CONTRACT, Contract
from tests.support.reconciler import (
    ALLOCATION_FINALIZER,
    NODE_FINALIZER,
    SCHEDULING_GATE,
    FirstFitPlanner,
    Harness,
    ListRecorder,
    MemoryWriter,
    Obj,
    claim,
    count_classifications,
    device_class,
    node_slice,
    pod,
)


def test_queue_orders_by_priority_then_age() -> None:
    h = Harness()
    for name, prio, created in [
        ("old-low", 0, "2026-01-01T00:00:00Z"),
        ("new-high", 10, "2026-01-01T00:05:00Z"),
        ("old-high", 10, "2026-01-01T00:01:00Z"),
        ("new-low", 0, "2026-01-01T00:09:00Z"),
    ]:
        h.add(Kind.CLAIM, claim(f"{name}-c"))
        h.add(Kind.POD, pod(name, [f"{name}-c"], priority=prio, created=created))
    h.rec.drain()
    assert h.rec.pending() == ["ns/old-high", "ns/new-high", "ns/old-low", "ns/new-low"]


def test_only_the_first_two_in_queue_order_get_the_two_devices() -> None:
    h = Harness(nodes={"n1": 2})
    h.add(Kind.CLAIM, claim("a-c"))
    h.add(Kind.POD, pod("a", ["a-c"], created="2026-01-01T00:00:01Z"))
    h.add(Kind.CLAIM, claim("b-c"))
    h.add(Kind.POD, pod("b", ["b-c"], priority=5, created="2026-01-01T00:00:09Z"))
    h.add(Kind.CLAIM, claim("c-c"))
    h.add(Kind.POD, pod("c", ["c-c"], created="2026-01-01T00:00:05Z"))
    h.step()
    allocated = {n for n, o in h.writer.objects.items() if o["status"].get("allocation")}
    assert allocated == {"b-c", "a-c"}
    assert not has_gate(h.current("a"), SCHEDULING_GATE)
    assert has_gate(h.current("c"), SCHEDULING_GATE)
    waits = [e for e in h.recorder.events if e[0] == "c"]
    assert waits == [("c", "Warning", "NoCapacity", "no node has 1 free devices")]
    assert h.writer.conditions["c"] == (False, "NoCapacity", "no node has 1 free devices")
    assert "a" not in h.writer.conditions, "placed at once: no condition to turn True"


def test_allocation_is_written_with_finalizer_then_gate_removed() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("c1"))
    h.add(Kind.POD, pod("p", ["c1"]))
    h.step()
    ops = h.writer.calls
    assert ops == [("add_finalizer", "c1"), ("write_allocation", "c1"), ("remove_gate", "p")]
    c = h.current("c1")
    assert has_finalizer(c, ALLOCATION_FINALIZER)
    alloc = c["status"]["allocation"]
    assert alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]
    assert alloc["devices"]["results"][0]["driver"] == "mig.carve.dev"


def test_model_sees_each_allocation_before_the_next_decision() -> None:
    """No watch events arrive between the two decisions: only the write's result feeds the model."""
    h = Harness(nodes={"n1": 3})
    for i in range(5):
        h.add(Kind.CLAIM, claim(f"c{i}"))
        h.add(Kind.POD, pod(f"p{i}", [f"c{i}"], created=f"2026-01-01T00:00:0{i}Z"))
    h.step()
    devices = h.allocated_devices()
    assert len(devices) == 3
    assert len(set(devices)) == 3


def test_all_claims_of_a_pod_or_none() -> None:
    h = Harness(nodes={"n1": 2})
    h.add(Kind.CLAIM, claim("x", count=2))
    h.add(Kind.CLAIM, claim("y", count=1))
    h.add(Kind.POD, pod("p", ["x", "y"]))
    h.step()
    assert h.allocated_devices() == []
    assert ("p", "Warning", "NoCapacity", "no node has 3 free devices") in h.recorder.events


def test_failed_second_write_rolls_back_the_first() -> None:
    h = Harness(nodes={"n1": 4})
    h.add(Kind.CLAIM, claim("x"))
    h.add(Kind.CLAIM, claim("y"))
    h.add(Kind.POD, pod("p", ["x", "y"]))
    h.writer.fail[("write_allocation", "y")] = WriteSkippedError("allocated by someone else")
    h.step()
    assert not h.current("x")["status"].get("allocation")
    assert has_gate(h.current("p"), SCHEDULING_GATE)
    # The next attempt (after the short retry delay) succeeds.
    h.now[0] += 2
    h.step()
    assert h.current("x")["status"].get("allocation")
    assert h.current("y")["status"].get("allocation")
    assert not has_gate(h.current("p"), SCHEDULING_GATE)


def test_unexpected_error_backs_off_and_retries() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.writer.fail[("add_finalizer", "c")] = RuntimeError("apiserver unavailable")
    h.step()
    assert not h.current("c")["status"].get("allocation")
    h.step()  # still backing off: no new write attempted
    assert h.writer.calls == [("add_finalizer", "c")]
    h.now[0] += 5
    h.step()
    assert h.current("c")["status"].get("allocation")


def test_an_api_error_while_writing_is_told_on_pod_claim_and_condition() -> None:
    """No silent waits: the apiserver's refusal reaches the objects the user looks at."""
    from kubernetes.client.exceptions import ApiException

    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    refusal = ApiException(status=422, reason="Unprocessable Entity")
    refusal.body = json.dumps({"message": 'ResourceClaim "c" is invalid: spec: field is immutable'})
    h.writer.fail[("write_allocation", "c")] = refusal
    h.step()
    [pod_event] = [e for e in h.recorder.events if e[0] == "p"]
    [claim_event] = [e for e in h.recorder.events if e[0] == "c"]
    assert pod_event[1:3] == ("Warning", "PlacementWriteFailed")
    assert "422" in pod_event[3] and "spec: field is immutable" in pod_event[3]
    assert claim_event[2] == "PlacementWriteFailed" and "pod ns/p" in claim_event[3]
    status, reason, message = h.writer.conditions["p"]
    assert (status, reason) == (False, "PlacementWriteFailed") and message == pod_event[3]
    # The same failure again is not repeated as a new event.
    h.writer.fail[("write_allocation", "c")] = refusal
    h.now[0] += 5
    h.step()
    assert len([e for e in h.recorder.events if e[0] == "p"]) == 1


def test_a_claim_the_apiserver_will_never_let_us_write_is_not_retried_blindly() -> None:
    from kubernetes.client.exceptions import ApiException

    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    refusal = ApiException(status=422, reason="Unprocessable Entity")
    refusal.body = json.dumps(
        {"message": 'ResourceClaim "c" is invalid: spec: Invalid value: null: field is immutable'}
    )
    h.writer.fail[("add_finalizer", "c")] = refusal
    h.step()
    [(_, _, reason, message)] = [e for e in h.recorder.events if e[0] == "p"]
    assert reason == "ClaimNotWritable" and "kubectl label" in message
    h.now[0] += 60
    h.step()  # permanent: no new write until the pod or claim changes
    assert h.writer.calls.count(("add_finalizer", "c")) == 1


def test_an_invalid_claim_is_reported_on_the_claim_too() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.planner.verdict = Unplaceable("InvalidClaim", "ResourceClaim ns/c: bad field", True)
    h.step()
    assert ("c", "Warning", "InvalidClaim", "pod ns/p: ResourceClaim ns/c: bad field") in (
        h.recorder.events
    )


def test_unknown_device_class_is_reported_and_others_proceed() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("bad", cls="3g.mig.carve.dev"))
    h.add(Kind.POD, pod("bad-pod", ["bad"], priority=100))
    h.add(Kind.CLAIM, claim("good"))
    h.add(Kind.POD, pod("good-pod", ["good"]))
    h.step()
    assert (
        "bad-pod",
        "Warning",
        "UnknownDeviceClass",
        "DeviceClass 3g.mig.carve.dev does not exist",
    ) in h.recorder.events
    assert h.current("good")["status"].get("allocation")
    # Creating the class wakes the pod even though the failure was permanent.
    h.add(Kind.CLASS, device_class("3g.mig.carve.dev"))
    h.step()
    assert h.current("bad")["status"].get("allocation")


def test_waiting_event_is_not_repeated() -> None:
    h = Harness(nodes={"n1": 0})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    for _ in range(5):
        h.now[0] += 60
        h.step()
    assert len([e for e in h.recorder.events if e[0] == "p"]) == 1


def test_capacity_change_retries_waiting_pod() -> None:
    h = Harness(nodes={"n1": 0})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert h.planner.plans == 1
    h.add(Kind.SLICE, node_slice("n2", 1))
    h.step()
    assert h.current("c")["status"]["allocation"]


def test_pod_without_carve_claims_is_ungated() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("other", cls="gpu.nvidia.com"))
    h.add(Kind.POD, pod("p", ["other"]))
    h.step()
    assert not has_gate(h.current("p"), SCHEDULING_GATE)
    assert not h.current("other")["status"].get("allocation")


def test_gated_pod_with_allocated_claims_is_just_ungated() -> None:
    """Crash recovery: allocation written, gate removal lost."""
    h = Harness()
    c = claim("c")
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    c["status"]["allocation"] = {"devices": {"results": []}}
    h.add(Kind.CLAIM, c)
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert h.writer.calls == [("remove_gate", "p")]


def test_not_synced_means_no_decision() -> None:
    planner, writer, rec = FirstFitPlanner(), MemoryWriter(), ListRecorder()
    r = Reconciler(planner, writer, rec)
    r.enqueue(Kind.CLAIM, EventType.ADDED, writer.put(claim("c")))
    r.enqueue(Kind.POD, EventType.ADDED, writer.put(pod("p", ["c"])))
    for k in Kind:
        if k is not Kind.NODE:
            r.mark_synced(k)
    r.step()
    assert writer.calls == []


def test_follower_makes_no_writes() -> None:
    leader = [False]
    planner, writer, rec = FirstFitPlanner(), MemoryWriter(), ListRecorder()
    r = Reconciler(planner, writer, rec, is_leader=lambda: leader[0])
    for k in Kind:
        r.mark_synced(k)
    r.enqueue(Kind.CLASS, EventType.ADDED, device_class())
    r.enqueue(Kind.SLICE, EventType.ADDED, node_slice("n1", 1))
    r.enqueue(Kind.CLAIM, EventType.ADDED, writer.put(claim("c")))
    r.enqueue(Kind.POD, EventType.ADDED, writer.put(pod("p", ["c"])))
    r.step()
    assert writer.calls == []
    leader[0] = True
    r.step()
    assert ("write_allocation", "c") in writer.calls


def test_stale_watch_event_does_not_hide_our_write() -> None:
    h = Harness(nodes={"n1": 1})
    c = h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    # The claim's ADDED event with the old resourceVersion arrives late.
    h.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c)
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"]))
    h.step()
    assert len(h.allocated_devices()) == 1


def test_postfilter_deallocation_is_replanned() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    # kube-scheduler PostFilter clears the allocation of the (ungated, unreserved) claim.
    c = h.current("c")
    c["status"].pop("allocation")
    h.update(Kind.CLAIM, c)
    h.rec.enqueue(Kind.POD, EventType.MODIFIED, h.current("p"))
    h.step()
    assert h.current("c")["status"].get("allocation")


# -- release handshake (invariant 4) ----------------------------------------------------------


def _allocated_claim(*finalizers: str, reserved: bool = False, deleting: bool = False) -> Obj:
    c = claim("c")
    c["metadata"]["finalizers"] = list(finalizers)
    c["status"]["allocation"] = {"devices": {"results": []}}
    if reserved:
        c["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}]
    if deleting:
        c["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return c


@pytest.mark.parametrize(
    ("finalizers", "reserved", "deleting", "consumers", "expected"),
    [
        ((ALLOCATION_FINALIZER,), True, False, 0, ReleaseKind.KEEP),
        ((ALLOCATION_FINALIZER,), False, False, 1, ReleaseKind.KEEP),
        ((ALLOCATION_FINALIZER, NODE_FINALIZER), False, False, 0, ReleaseKind.WAIT_NODE),
        ((ALLOCATION_FINALIZER,), False, False, 0, ReleaseKind.CLEAR),
        ((ALLOCATION_FINALIZER, NODE_FINALIZER), False, True, 1, ReleaseKind.WAIT_NODE),
        ((ALLOCATION_FINALIZER,), True, True, 0, ReleaseKind.KEEP),
        ((ALLOCATION_FINALIZER,), False, True, 1, ReleaseKind.DROP_FINALIZER),
        ((NODE_FINALIZER,), False, False, 0, ReleaseKind.KEEP),
        # Another domain's finalizer is not a node's confirmation pending.
        ((ALLOCATION_FINALIZER, "example.com/x"), False, False, 0, ReleaseKind.CLEAR),
    ],
)
def test_release_action(
    finalizers: tuple[str, ...],
    reserved: bool,
    deleting: bool,
    consumers: int,
    expected: ReleaseKind,
) -> None:
    c = _allocated_claim(*finalizers, reserved=reserved, deleting=deleting)
    assert release_action(c, consumers) is expected


def test_release_waits_for_node_finalizer_then_clears_then_drops() -> None:
    h = Harness()
    h.add(Kind.CLAIM, claim("c"))
    p = h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    # Node carved: plugin finalizer; pod bound and reserved.
    c = h.current("c")
    c["metadata"]["finalizers"].append(NODE_FINALIZER)
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": p["metadata"]["uid"]}]
    h.update(Kind.CLAIM, c)
    h.step()
    # Pod finished; KCM removed the reservation; node has not torn down yet.
    done = h.current("p")
    done["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, done)
    c = h.current("c")
    c["status"]["reservedFor"] = []
    h.update(Kind.CLAIM, c)
    h.writer.calls.clear()
    h.step()
    assert h.writer.calls == []
    assert h.current("c")["status"]["allocation"]
    # Node confirms destruction.
    c = h.current("c")
    c["metadata"]["finalizers"].remove(NODE_FINALIZER)
    h.update(Kind.CLAIM, c)
    h.step()
    assert h.writer.calls == [("clear_allocation", "c"), ("remove_finalizer", "c")]
    assert not h.current("c")["status"].get("allocation")
    assert not has_finalizer(h.current("c"), ALLOCATION_FINALIZER)


def test_released_placement_is_reused() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))
    h.step()
    assert not h.current("d")["status"].get("allocation")
    done = h.current("p")
    done["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, done)
    h.step()
    assert h.current("d")["status"]["allocation"]


def test_deleting_claim_only_loses_its_finalizer() -> None:
    h = Harness()
    c = _allocated_claim(ALLOCATION_FINALIZER, deleting=True)
    h.add(Kind.CLAIM, c)
    h.step()
    assert h.writer.calls == [("remove_finalizer", "c")]


# -- native fallback ------------------------------------------------------------------------------


def test_native_fallback_ungates_after_grace() -> None:
    h = Harness(nodes={"n1": 0}, native_fallback_after=60.0)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"], created="2026-01-01T00:00:00Z"))
    h.step()
    assert has_gate(h.current("p"), SCHEDULING_GATE)
    h.wall[0] += dt.timedelta(seconds=120)
    h.now[0] += 60
    h.step()
    assert not has_gate(h.current("p"), SCHEDULING_GATE)
    assert any(e[2] == "HandedToScheduler" for e in h.recorder.events)
    # Never re-planned afterwards: it belongs to kube-scheduler now.
    h.add(Kind.SLICE, node_slice("n2", 1))
    h.step()
    assert not h.current("c")["status"].get("allocation")


# -- pure classification ------------------------------------------------------------------


def test_template_claim_not_yet_created_waits() -> None:
    p = pod("p", [])
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    w = pod_work(p, {}, CarveClasses())
    assert w.kind is WorkKind.WAIT
    assert "kube-controller-manager" in w.message
    p["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "p-gpu-x"}]
    c = claim("p-gpu-x")
    assert pod_work(p, {"ns/p-gpu-x": c}, CarveClasses()).kind is WorkKind.PLACE


def test_first_available_counts_as_carve() -> None:
    c = claim("c", cls="other.example.com")
    c["spec"]["devices"]["requests"] = [
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "other.example.com"},
                {"name": "small", "deviceClassName": "1g.mig.carve.dev"},
            ],
        }
    ]
    p = pod("p", ["c"])
    assert pod_work(p, {"ns/c": c}, CarveClasses()).kind is WorkKind.PLACE


@given(
    st.lists(
        st.tuples(st.integers(-5, 5), st.integers(0, 59)), min_size=1, max_size=30, unique=True
    )
)
@settings(max_examples=50, deadline=None)
def test_priority_key_is_total_order(entries: list[tuple[int, int]]) -> None:
    pods = [
        pod(f"p{i}", [], priority=p, created=f"2026-01-01T00:00:{s:02d}Z")
        for i, (p, s) in enumerate(entries)
    ]
    ordered = sorted(pods, key=priority_key)
    for a, b in itertools.pairwise(ordered):
        pa, pb = a["spec"]["priority"], b["spec"]["priority"]
        assert pa > pb or (
            pa == pb and a["metadata"]["creationTimestamp"] <= b["metadata"]["creationTimestamp"]
        )


@given(
    st.lists(st.tuples(st.integers(1, 3), st.booleans()), min_size=1, max_size=12),
    st.integers(1, 8),
)
@settings(max_examples=40, deadline=None)
def test_no_device_is_ever_double_booked(arrivals: list[tuple[int, bool]], capacity: int) -> None:
    """Arrivals and completions in any order never give one device to two live claims."""
    h = Harness(nodes={"n1": capacity, "n2": capacity})
    live: list[str] = []
    for i, (count, finish_one) in enumerate(arrivals):
        h.add(Kind.CLAIM, claim(f"c{i}", count=count))
        h.add(Kind.POD, pod(f"p{i}", [f"c{i}"], created=f"2026-01-01T00:{i:02d}:00Z"))
        live.append(f"p{i}")
        if finish_one and live:
            done = h.current(live.pop(0))
            done["status"]["phase"] = "Succeeded"
            h.update(Kind.POD, done)
        h.step()
        devices = h.allocated_devices()
        assert len(devices) == len(set(devices))
        assert len(devices) <= 2 * capacity


def test_a_generated_claim_is_kept_allocated_until_its_deletion() -> None:
    """Its pod is done or gone; kube-controller-manager deletes it, which releases it."""
    c = _allocated_claim(ALLOCATION_FINALIZER)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": True}
    c["metadata"]["ownerReferences"] = [owner]
    assert release_action(c, 0) is ReleaseKind.KEEP
    c["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert release_action(c, 0) is ReleaseKind.DROP_FINALIZER
    # Owned but not controlled by a pod (a user's own claim with an owner): cleared as before.
    c = _allocated_claim(ALLOCATION_FINALIZER)
    c["metadata"]["ownerReferences"] = [{**owner, "controller": False}]
    assert release_action(c, 0) is ReleaseKind.CLEAR


def test_the_node_finalizer_of_the_contract_holds_the_release() -> None:
    """The controller waits for exactly the finalizer the plugin writes, for any driver name."""
    c = _allocated_claim(ALLOCATION_FINALIZER, DEFAULT_CONTRACT.node_finalizer("gpu-node-1"))
    assert release_action(c, 0) is ReleaseKind.WAIT_NODE
    c = _allocated_claim(ALLOCATION_FINALIZER, DEFAULT_CONTRACT.node_finalizer("n" * 200))
    assert release_action(c, 0) is ReleaseKind.WAIT_NODE

    renamed = Contract("mig.example.com")
    c = _allocated_claim(renamed.allocation_finalizer, renamed.node_finalizer("gpu-node-1"))
    assert release_action(c, 0, renamed) is ReleaseKind.WAIT_NODE
    # The default contract's controller neither owns this claim nor mistakes its finalizers.
    assert release_action(c, 0) is ReleaseKind.KEEP
    c = _allocated_claim(renamed.allocation_finalizer)
    assert release_action(c, 0, renamed) is ReleaseKind.CLEAR


def test_repeated_postfilter_deallocation_backs_off_then_leaves_pod_to_scheduler() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()

    def scheduler_clears() -> None:
        c = h.current("c")
        c["status"].pop("allocation")
        h.update(Kind.CLAIM, c)
        p = h.current("p")
        p["status"]["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "message": "0/1 nodes are available: 1 Insufficient example.com/foo.",
            }
        ]
        h.update(Kind.POD, p)

    for round_ in range(3):
        scheduler_clears()
        h.step()
        assert h.current("c")["status"].get("allocation"), f"round {round_} not re-placed"
        h.now[0] += 2.0 ** (round_ + 1)
    scheduler_clears()
    h.step()
    assert not h.current("c")["status"].get("allocation")
    assert not has_finalizer(h.current("c"), ALLOCATION_FINALIZER)
    reasons = [e[2] for e in h.recorder.events if e[0] == "p"]
    assert reasons.count("AllocationCleared") == 3
    assert reasons[-1] == "SchedulerRejectedPlacement"
    last = [e for e in h.recorder.events if e[0] == "p"][-1][3]
    assert "Insufficient example.com/foo" in last
    # Never touched again.
    h.now[0] += 100
    h.step()
    assert not h.current("c")["status"].get("allocation")


def test_replan_waits_for_its_backoff() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    for _ in range(2):
        c = h.current("c")
        c["status"].pop("allocation")
        h.update(Kind.CLAIM, c)
        h.step()
    # The second clearing came right after the first re-plan: it waits 2s before placing again.
    assert not h.current("c")["status"].get("allocation")
    h.now[0] += 2.5
    h.step()
    assert h.current("c")["status"].get("allocation")


def test_missing_generated_claim_is_reported_only_when_it_lasts() -> None:
    h = Harness()
    p = pod("p", [])
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    h.add(Kind.POD, p)
    h.step()
    assert [e for e in h.recorder.events if e[0] == "p"] == []
    h.now[0] += 31
    h.step()
    (ev,) = [e for e in h.recorder.events if e[0] == "p"]
    assert ev[2] == "ClaimsNotReady"
    assert "kube-controller-manager" in ev[3]


def test_a_pass_looks_only_at_pods_that_can_need_the_controller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bound pods, pods without claims or gate, and pods being deleted are not examined (the
    reconciler keeps a candidate set rather than scanning every cached pod)."""
    examined = count_classifications(monkeypatch)
    h = Harness()
    h.add(Kind.CLAIM, claim("c1"))
    h.add(Kind.POD, pod("waiting", ["c1"]))
    bound = pod("bound", ["c1"], gated=False)
    bound["spec"]["nodeName"] = "n1"
    h.add(Kind.POD, bound)
    plain = pod("plain", [], gated=False)
    h.add(Kind.POD, plain)
    leaving = pod("leaving", ["c1"])
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z"
    h.add(Kind.POD, leaving)
    h.rec.drain()
    assert h.rec.pending() == ["ns/waiting"]
    assert set(examined) == {"waiting"}
    # The waiting pod is bound by someone else: it leaves the candidates, and the queue.
    now_bound = h.current("waiting")
    now_bound["spec"]["nodeName"] = "n1"
    now_bound["spec"].pop("schedulingGates")
    h.update(Kind.POD, now_bound)
    h.rec.drain()
    assert h.rec.pending() == []
