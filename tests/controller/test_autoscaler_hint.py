"""carve's Unschedulable hint for Cluster Autoscaler, and safe-to-evict (issue 44 item 5).

The writer (`KubeClaimWriter`) against `VersionedStore`, the stand-in for the apiserver's
patches; the reconciler's decisions against the in-memory writer of tests/support/reconciler.py.
CA's own check (`ca_sees_unschedulable`, tests/support/autoscaler.py) judges every hint. The
real control plane is in tests/controller/cluster/test_autoscaler_cluster.py.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from controller.autoscaling import (
    HINT_PREFIX,
    SAFE_TO_EVICT,
    SCHEDULING_GATED,
    GateGoneError,
    hint_message,
    lacks_capacity,
)
from controller.objects import EventType, Kind, Unplaceable
from controller.status import KubeClaimWriter
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT
from tests.support.autoscaler import ca_sees_unschedulable, pod_scheduled
from tests.support.engine_cluster import Cluster, profile_claim
from tests.support.patch_store import VersionedStore
from tests.support.reconciler import NODE_FINALIZER, Harness, claim, pod

GATE = DEFAULT_CONTRACT.scheduling_gate
NOW = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
NO_ROOM = Unplaceable(
    "InsufficientDevices",
    "no free placement: claim ns/c, request gpu: no A100-SXM4-40GB GPU has a free 3g.20gb "
    "placement",
)


class PathStore(VersionedStore):
    """`VersionedStore` that also records each PATCH's path and operations, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.patches: list[tuple[str, Any]] = []

    def request(self, method: str, path: str, **kw: Any) -> Obj:
        if method == "PATCH":
            self.patches.append((path.rsplit("/", 1)[-1], kw.get("body")))
        return super().request(method, path, **kw)


def _gated_pod(**meta: Any) -> Obj:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "pu", **meta},
        "spec": {"schedulingGates": [{"name": GATE}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": SCHEDULING_GATED,
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                }
            ],
        },
    }


def _writer(store: VersionedStore) -> KubeClaimWriter:
    return KubeClaimWriter(store, clock=lambda: NOW)


# -- the writer ------------------------------------------------------------------------------


def test_the_hint_is_what_cluster_autoscaler_acts_on_and_is_sent_once() -> None:
    store = PathStore()
    p = store.add(_gated_pod())
    assert not ca_sees_unschedulable(p), "a gated pod as the apiserver made it: CA skips it"
    out = _writer(store).set_unschedulable(p, "carve cannot place this pod: no room")
    assert ca_sees_unschedulable(out)
    cond = pod_scheduled(out)
    assert cond is not None
    assert cond["message"] == "carve cannot place this pod: no room"
    [(target, ops)] = store.patches
    assert target == "status", "through pods/status, never the pod itself"
    assert ops[1] == {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE}
    assert store.kinds == ["application/json-patch+json"]
    assert _writer(store).set_unschedulable(out, "carve cannot place this pod: no room") is out
    assert len(store.patches) == 1, "the same hint again: no request"


def test_the_hint_never_lands_on_a_pod_carve_has_ungated() -> None:
    """Hints are written beside the decision: one queued before the gate went must fail."""
    store = PathStore()
    stale = store.add(_gated_pod())
    fresh = dict(stale, spec={"schedulingGates": []})
    store.add(fresh)  # the gate went meanwhile; the writer still holds the gated copy
    with pytest.raises(GateGoneError, match="gate is gone"):
        _writer(store).set_unschedulable(stale, "no room")
    assert not ca_sees_unschedulable(store.objs[("ns", "p")])
    assert [t for t, _ in store.patches] == ["status"], "one failed test (422), then nothing"


def test_the_gate_goes_only_after_the_hint_is_reset() -> None:
    store = PathStore()
    w = _writer(store)
    hinted = w.set_unschedulable(store.add(_gated_pod()), "no room")
    out = w.remove_gate(hinted)
    assert [t for t, _ in store.patches] == ["status", "status", "p"], "hint, reset, gate"
    cond = pod_scheduled(out)
    assert cond is not None and cond["reason"] == SCHEDULING_GATED
    assert not out["spec"]["schedulingGates"]
    assert not ca_sees_unschedulable(out)


def test_a_hint_that_lands_while_the_gate_is_removed_is_reset_first() -> None:
    """The removal tests the PodScheduled reason it was derived under: a hint written in
    between (a write beside the decision) fails it, is reset, and only then the gate goes."""
    store = PathStore()
    w = _writer(store)
    p = store.add(_gated_pod())

    def hint_lands(cur: Obj) -> None:
        store.add(w.set_unschedulable(cur, "no room"))

    store.before_put = hint_lands
    out = w.remove_gate(p)
    assert not out["spec"]["schedulingGates"]
    cond = pod_scheduled(out)
    assert cond is not None and cond["reason"] == SCHEDULING_GATED, out["status"]
    targets = [t for t, _ in store.patches]
    assert targets[-2:] == ["status", "p"], targets


def test_a_reset_never_undoes_kube_schedulers_verdict() -> None:
    """Once carve's gate is gone, PodScheduled is kube-scheduler's: no reset is sent."""
    store = PathStore()
    p = _gated_pod()
    p["spec"]["schedulingGates"] = []
    p["status"]["conditions"][0].update(reason="Unschedulable", message="0/3 nodes")
    out = _writer(store).reset_unschedulable(store.add(p))
    assert store.patches == []
    assert ca_sees_unschedulable(out)


@pytest.mark.parametrize(
    ("annotations", "protect", "expected"),
    [
        (None, True, {SAFE_TO_EVICT: "false"}),
        ({}, True, {SAFE_TO_EVICT: "false"}),
        ({"example.com/a": "1"}, True, {"example.com/a": "1", SAFE_TO_EVICT: "false"}),
        ({SAFE_TO_EVICT: "true"}, True, {SAFE_TO_EVICT: "true"}),  # the user's, kept
        ({DEFAULT_CONTRACT.movable_annotation: "true"}, True, None),  # opted in as movable
        (None, False, None),  # no slice held (no carve claims)
    ],
    ids=["no-map", "empty-map", "other-keys", "users-value", "movable", "no-slice"],
)
def test_placed_pods_are_not_safe_to_evict_unless_movable_or_the_user_says(
    annotations: dict[str, str] | None, protect: bool, expected: dict[str, str] | None
) -> None:
    store = PathStore()
    meta = {} if annotations is None else {"annotations": annotations}
    p = store.add(_gated_pod(**meta))
    out = _writer(store).remove_gate(p, protect=protect)
    got = out["metadata"].get("annotations")
    if expected is None:
        assert SAFE_TO_EVICT not in (got or {})
    else:
        assert got == expected
    assert len(store.patches) == 1, "one write: the gate and the annotation together"


def test_a_map_added_meanwhile_is_kept_when_safe_to_evict_is_added() -> None:
    """The informer's copy showed no annotations; the pod got some since. Adding the whole map
    would drop them: the patch tests that there is none, fails, and adds the key instead."""
    store = PathStore()
    p = store.add(_gated_pod())
    fresh = dict(p, metadata=dict(p["metadata"], annotations={"example.com/late": "x"}))
    store.add(fresh)
    out = _writer(store).remove_gate(p, protect=True)
    assert out["metadata"]["annotations"] == {"example.com/late": "x", SAFE_TO_EVICT: "false"}
    assert not out["spec"]["schedulingGates"]


def test_pin_and_ungate_resets_the_hint_and_protects_the_pod() -> None:
    store = PathStore()
    w = _writer(store)
    p = store.add(_gated_pod())
    p["spec"]["containers"] = [{"name": "c"}]
    hinted = w.set_unschedulable(store.add(p), "no room")
    out = w.pin_and_ungate(hinted, "n1")
    assert [t for t, _ in store.patches] == ["status", "status", "p"]
    assert not ca_sees_unschedulable(out)
    assert out["metadata"]["annotations"] == {SAFE_TO_EVICT: "false"}


# -- what counts as lack of capacity ------------------------------------------------------------


@pytest.mark.parametrize(
    ("why", "told"),
    [
        (NO_ROOM, True),
        (Unplaceable("NodeMisfit", "0/2 GPU nodes can take the pod: ..."), True),
        (Unplaceable("NoNode", "no node publishes carve GPUs"), True),
        (Unplaceable("PreemptionBlocked", "...; their PodDisruptionBudgets forbid it"), True),
        (Unplaceable("Preempting", "preempting on node n1: evicted ns/low"), False),
        (Unplaceable("PreemptionPending", "waiting for the slices of ns/low"), False),
        (Unplaceable("InvalidClaim", "ResourceClaim ns/c: bad", permanent=True), False),
        (Unplaceable("NoMatchingDevice", "the pod has no device requests", True), False),
        (Unplaceable("ClaimsNotReady", "claim ns/c does not exist yet"), False),
        (Unplaceable("PlacementWriteFailed", "the API server answered 500"), False),
        (Unplaceable("CarveFailed", "carve failed 3 times"), False),
        (Unplaceable("AllocationConflict", "claim ns/c is in a conflict"), False),
    ],
    ids=lambda v: v.reason if isinstance(v, Unplaceable) else str(v),
)
def test_only_a_lack_of_capacity_is_told_to_the_autoscaler(why: Unplaceable, told: bool) -> None:
    assert lacks_capacity(why) is told


def test_the_message_says_what_was_asked_and_why_nothing_fit() -> None:
    c = claim("c", count=2, cls="mig-3g-20gb.mig.carve.dev")
    message = hint_message([c], NO_ROOM)
    assert message.startswith(HINT_PREFIX)
    assert "claim c (2 x mig-3g-20gb.mig.carve.dev)" in message
    assert NO_ROOM.message in message


# -- the reconciler's decisions -------------------------------------------------------------------


def _hinted(h: Harness, name: str = "p") -> bool:
    return ca_sees_unschedulable(h.current(name))


def _one_pod_told(verdict: Unplaceable) -> Harness:
    """One GPU node and pod p with claim c, after a step in which the planner said ``verdict``."""
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.planner.verdict = verdict
    h.step()
    return h


def test_a_pod_that_lacks_capacity_gets_the_hint_once_and_loses_it_before_its_gate() -> None:
    h = _one_pod_told(NO_ROOM)
    assert _hinted(h)
    cond = pod_scheduled(h.current("p"))
    assert cond is not None and NO_ROOM.message in cond["message"]
    assert "claim c (1 x mig.carve.dev)" in cond["message"]
    for _ in range(3):  # retries, a resync, the informer's copy of the hinted pod
        h.now[0] += 31
        h.rec.resync()
        h.update(Kind.POD, h.current("p"))
        h.step()
    assert h.writer.pod_writes == [("set_unschedulable", "p")], "written when it changes only"

    h.planner.verdict = None
    h.now[0] += 31
    h.step()
    assert h.writer.pod_writes == [
        ("set_unschedulable", "p"),
        ("reset_unschedulable", "p"),
        ("remove_gate", "p"),
    ]
    placed = h.current("p")
    assert not placed["spec"]["schedulingGates"]
    assert not ca_sees_unschedulable(placed)
    assert placed["metadata"]["annotations"] == {SAFE_TO_EVICT: "false"}


def test_no_hint_while_kube_schedulers_fallback_is_off_and_the_refusal_is_no_capacity() -> None:
    """The harness planner's own refusal (`NoCapacity`) is not one of the engine's capacity
    reasons: nothing is told, and the rest of the suite's write sequences stay as they were."""
    h = Harness(nodes={"n1": 0})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert h.writer.pod_writes == []
    assert not _hinted(h)


class _Preempting:
    def unplaceable(self, pod: Obj, claims: Any, why: Unplaceable, stores: Any) -> Unplaceable:
        return Unplaceable("Preempting", "preempting on node n1: evicted ns/low")


def test_no_hint_while_carve_preempts_for_the_pod_and_a_hint_set_before_is_reset() -> None:
    h = _one_pod_told(NO_ROOM)
    assert _hinted(h)
    h.rec._placer._preemption = _Preempting()  # a lower-priority pod arrived meanwhile
    h.now[0] += 31
    h.step()
    assert not _hinted(h)
    assert h.writer.pod_writes[-1] == ("reset_unschedulable", "p")

    fresh = Harness(nodes={"n1": 1}, preemption=_Preempting())
    fresh.add(Kind.CLAIM, claim("c"))
    fresh.add(Kind.POD, pod("p", ["c"]))
    fresh.planner.verdict = NO_ROOM
    fresh.step()
    assert fresh.writer.pod_writes == []


def test_no_hint_while_the_preempted_slices_are_being_released() -> None:
    h = _one_pod_told(Unplaceable("PreemptionPending", "waiting for the slices of ns/low"))
    assert h.writer.pod_writes == []


def test_no_hint_while_a_queue_holds_the_pod() -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    queued = pod("p", ["c"])
    queued["spec"]["schedulingGates"].insert(0, {"name": "kueue.x-k8s.io/admission"})
    h.add(Kind.POD, queued)
    h.planner.verdict = NO_ROOM
    h.step()
    assert h.writer.pod_writes == []
    assert any(e[2] != "InsufficientDevices" for e in h.recorder.events if e[0] == "p")


def test_no_hint_while_a_release_in_flight_would_fit_the_pod() -> None:
    """A pod that ended left its claim allocated until the node confirms the teardown: a
    pod that fits once that slice is free waits for the release, not for a new node."""
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("old"))
    h.add(Kind.POD, pod("a", ["old"]))
    h.step()
    old = h.current("old")
    assert old["status"].get("allocation")
    old["metadata"]["finalizers"] = [*old["metadata"].get("finalizers", []), NODE_FINALIZER]
    h.update(Kind.CLAIM, old)
    ended = h.current("a")
    ended["spec"]["nodeName"] = "n1"
    ended["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, ended)
    h.step()

    h.planner.verdict = NO_ROOM
    h.planner.freeing = {"ns/old"}
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    h.step()
    assert ("set_unschedulable", "p") not in h.writer.pod_writes

    h.planner.freeing = set()  # the freed slice would not fit it after all
    h.now[0] += 31
    h.step()
    assert _hinted(h)


def test_native_fallback_resets_the_hint_before_handing_the_pod_over() -> None:
    h = Harness(nodes={"n1": 1}, native_fallback_after=60.0)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"], created="2026-01-01T00:00:00Z"))
    h.planner.verdict = NO_ROOM
    h.step()
    assert _hinted(h)
    h.wall[0] += dt.timedelta(minutes=2)
    h.now[0] += 31
    h.step()
    assert h.writer.pod_writes[-2:] == [("reset_unschedulable", "p"), ("remove_gate", "p")]
    assert not _hinted(h)


def test_the_engine_tells_a_release_that_fits_from_one_that_does_not() -> None:
    """The real engine's what-if (`controller.whatif`): a 7g.40gb slice whose pod ended but
    whose node has not confirmed the teardown is a release in flight. A 3g.20gb pod fits in
    it (no hint); a pod asking for two 7g.40gb would not (hint), and a like pod's question
    costs no second what-if."""
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    a = c.submit(profile_claim("whole", "7g.40gb"))
    c.rec.step()
    assert c.allocation("whole") is not None
    held = c.writer.objects["whole"]
    held["metadata"]["finalizers"] = [*held["metadata"]["finalizers"], NODE_FINALIZER]
    c.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c.writer.put(held))
    c.finish(a)
    c.rec.step()

    small = c.submit(profile_claim("small", "3g.20gb"))
    big = c.submit(profile_claim("big", "7g.40gb", count=2))
    c.rec.step()
    assert not ca_sees_unschedulable(c.writer.objects[small]), "it waits for the release"
    assert ca_sees_unschedulable(c.writer.objects[big]), "no release makes room for two"
    assert c.allocation("small") is None and c.allocation("big") is None

    calls = []
    real = c.planner.placement_without

    def counted(*args: Any) -> Any:
        calls.append(args[1])
        return real(*args)

    c.planner.placement_without = counted  # type: ignore[method-assign]
    like = [c.submit(profile_claim(f"small-{i}", "3g.20gb")) for i in range(3)]
    c.rec.step()
    assert not any(ca_sees_unschedulable(c.writer.objects[p]) for p in like)
    assert len(calls) <= 1, calls


@pytest.mark.parametrize(
    ("value", "warned"), [("yes please", True), ("true", False), ("False", False)]
)
def test_a_movable_annotation_carve_cannot_read_is_told_on_the_placed_pod(
    value: str, warned: bool
) -> None:
    h = Harness(nodes={"n1": 1})
    h.add(Kind.CLAIM, claim("c"))
    p = pod("p", ["c"])
    p["metadata"]["annotations"] = {DEFAULT_CONTRACT.movable_annotation: value}
    h.add(Kind.POD, p)
    h.step()
    reasons = [e[2] for e in h.recorder.events if e[0] == "p"]
    assert "Placed" in reasons, reasons
    assert ("MovableAnnotationIgnored" in reasons) is warned, reasons
    if warned:
        message = next(e[3] for e in h.recorder.events if e[2] == "MovableAnnotationIgnored")
        assert '"yes please"' in message and SAFE_TO_EVICT in message
