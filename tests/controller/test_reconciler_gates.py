"""Another scheduling gate (Kueue's admission gate) holds a pod: carve waits, says so once.

Uses the in-memory harness of tests/support/reconciler.py; the same rule against the real
apiserver and the real Kueue is in tests/controller/cluster/test_kueue_cluster.py.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from controller.objects import CarveClasses, Kind, has_gate, other_gates
from controller.work import GATED_ELSEWHERE, WorkKind, pod_work
from driver.apiobject import Obj
from tests.support.reconciler import SCHEDULING_GATE, Harness, claim, pod

KUEUE_GATE = "kueue.x-k8s.io/admission"


def _held(name: str, claims: list[str], *gates: str, **kw: Any) -> Obj:
    p = pod(name, claims, **kw)
    p["spec"]["schedulingGates"] = [{"name": g} for g in gates]
    return p


def _drop(p: Obj, gate: str) -> Obj:
    p["spec"]["schedulingGates"] = [g for g in p["spec"]["schedulingGates"] if g["name"] != gate]
    return p


def test_other_gates_lists_every_gate_but_carves_in_order() -> None:
    p = _held("p", [], "b.example/x", SCHEDULING_GATE, KUEUE_GATE)
    assert other_gates(p, SCHEDULING_GATE) == ["b.example/x", KUEUE_GATE]
    assert other_gates(_held("q", [], SCHEDULING_GATE), SCHEDULING_GATE) == []


def test_a_foreign_gate_makes_the_pod_wait_whatever_its_claims() -> None:
    c = claim("c")
    for gates in ([KUEUE_GATE, SCHEDULING_GATE], [SCHEDULING_GATE, KUEUE_GATE]):
        w = pod_work(_held("p", ["c"], *gates), {"ns/c": c}, CarveClasses())
        assert w.kind is WorkKind.WAIT
        assert w.reason == GATED_ELSEWHERE
        assert KUEUE_GATE in w.message
    # Even a pod whose claims are already allocated keeps carve's gate while another is there.
    done = claim("d")
    done["status"]["allocation"] = {"devices": {"results": []}}
    w = pod_work(_held("p", ["d"], KUEUE_GATE, SCHEDULING_GATE), {"ns/d": done}, CarveClasses())
    assert w.kind is WorkKind.WAIT
    # Only carve's gate left: placed as usual.
    assert pod_work(_held("p", ["c"], SCHEDULING_GATE), {"ns/c": c}, CarveClasses()).kind is (
        WorkKind.PLACE
    )


def test_a_pod_without_carves_gate_is_not_carves_business() -> None:
    w = pod_work(_held("p", ["c"], KUEUE_GATE), {"ns/c": claim("c")}, CarveClasses())
    assert w.kind is WorkKind.NONE


def test_held_pod_is_not_placed_until_the_foreign_gate_goes_and_is_told_once() -> None:
    h = Harness(nodes={"n1": 2})
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, _held("p", ["c"], KUEUE_GATE, SCHEDULING_GATE))
    for _ in range(5):
        h.now[0] += 400  # past event_interval: a capacity wait would be told again by now
        h.step()
    assert h.planner.plans == 0
    assert not h.current("c")["status"].get("allocation")
    assert has_gate(h.current("p"), SCHEDULING_GATE)
    told = [e for e in h.recorder.events if e[0] == "p"]
    assert [(e[1], e[2]) for e in told] == [("Normal", GATED_ELSEWHERE)]
    assert KUEUE_GATE in told[0][3]
    assert h.writer.conditions["p"][:2] == (False, GATED_ELSEWHERE)

    h.update(Kind.POD, _drop(h.current("p"), KUEUE_GATE))
    h.step()
    assert h.current("c")["status"]["allocation"]
    assert not h.current("p")["spec"]["schedulingGates"]
    assert h.writer.conditions["p"][1] == "Placed"


def test_time_held_by_a_queue_does_not_count_towards_the_native_fallback() -> None:
    """An unplaceable pod admitted by Kueue after an hour in its queue gets the full
    `native_fallback_after` of carve's own attempts before it is handed to kube-scheduler."""
    h = Harness(nodes={"n1": 0}, native_fallback_after=60.0)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, _held("p", ["c"], KUEUE_GATE, SCHEDULING_GATE))
    h.step()
    h.wall[0] += dt.timedelta(hours=1)
    h.now[0] += 3600
    h.step()  # still held
    assert h.planner.plans == 0
    h.update(Kind.POD, _drop(h.current("p"), KUEUE_GATE))
    h.step()  # carve sees the queue's gate go: the fallback clock starts here
    assert h.planner.plans == 1
    h.wall[0] += dt.timedelta(seconds=30)
    h.now[0] += 30
    h.step()  # the retry: 30 s of carve's own attempts, under native_fallback_after
    assert has_gate(h.current("p"), SCHEDULING_GATE)
    assert h.planner.plans == 2
    h.wall[0] += dt.timedelta(seconds=40)
    h.now[0] += 40
    h.step()
    assert not has_gate(h.current("p"), SCHEDULING_GATE)
    assert any(e[2] == "HandedToScheduler" for e in h.recorder.events)


class _Depth:
    def __init__(self) -> None:
        self.depth: list[int] = []

    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None: ...

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None: ...

    def set_queue_depth(self, depth: int) -> None:
        self.depth.append(depth)

    def count_outcome(self, outcome: str) -> None: ...

    def set_conflicts(self, gpus: int) -> None: ...

    def set_duplicate_gpus(self, gpus: int) -> None: ...

    def set_contract_skew(self, nodes: int) -> None: ...


def test_pods_held_by_a_queue_are_not_counted_as_pending_for_carve() -> None:
    metrics = _Depth()
    h = Harness(nodes={"n1": 0}, metrics=metrics)
    h.add(Kind.CLAIM, claim("a"))
    h.add(Kind.CLAIM, claim("b"))
    h.add(Kind.POD, _held("queued", ["a"], KUEUE_GATE, SCHEDULING_GATE))
    h.add(Kind.POD, pod("carves", ["b"]))  # carve's gate only, no room: carve's to place
    h.step()
    assert metrics.depth[-1] == 1
