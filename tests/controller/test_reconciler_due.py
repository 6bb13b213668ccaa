"""A pass visits only the pods that changed, were woken, or whose time came (controller.podqueue).

Uses the in-memory harness of tests/support/reconciler.py. The risk of visiting less is a pod
nobody wakes: the property test below checks, after any sequence of changes, that every kept
classification is what `pod_work` says now and that every placeable pod is tried once its
retry time has come.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.objects import EventType, Kind, Unplaceable, key_of
from controller.work import PodWork, WorkKind, pod_work
from tests.support.reconciler import Harness, claim, count_classifications, pod


def test_a_pass_classifies_and_decides_only_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = count_classifications(monkeypatch)
    h = Harness()
    h.planner.verdict = Unplaceable("NoCapacity", "full")
    h.add(Kind.CLAIM, claim("shared"))
    for i in range(40):
        h.add(Kind.CLAIM, claim(f"c{i}"))
        h.add(Kind.POD, pod(f"p{i:02d}", [f"c{i}", "shared"] if i < 2 else [f"c{i}"]))
    h.step()
    assert len(seen) == 40 and h.planner.plans == 40

    seen.clear()
    h.step()  # nothing changed, no retry due: nothing looked at
    assert seen == [] and h.planner.plans == 40

    p = h.current("p07")
    p["metadata"]["labels"] = {"touched": "yes"}
    h.update(Kind.POD, p)
    h.step()
    assert seen == ["p07"] and h.planner.plans == 41

    seen.clear()
    h.update(Kind.CLAIM, h.current("shared"))
    h.step()
    assert sorted(seen) == ["p00", "p01"] and h.planner.plans == 43

    seen.clear()
    h.now[0] += 31  # every retry (retry_interval 30 s) comes due: decided again, not classified
    h.step()
    assert seen == [] and h.planner.plans == 83


def test_capacity_coming_free_wakes_a_waiting_pod_before_its_retry() -> None:
    h = Harness(nodes={"n1": 1})
    for name in ("a", "b"):
        h.add(Kind.CLAIM, claim(f"c-{name}"))
        h.add(Kind.POD, pod(name, [f"c-{name}"], created=f"2026-01-01T00:00:0{ord(name) - 96}Z"))
    h.step()
    assert h.current("c-a")["status"].get("allocation")
    assert not h.current("c-b")["status"].get("allocation")
    done = h.current("a")
    done["status"]["phase"] = "Succeeded"
    h.update(Kind.POD, done)
    h.step()  # the release: the claim's allocation is cleared
    h.step()  # the clock has not moved: only the wake can bring b forward
    assert h.current("c-b")["status"].get("allocation")


# -- property: nothing is forgotten -------------------------------------------------------------

_POD_NAMES = [f"p{i}" for i in range(5)]
_CLAIM_NAMES = [f"c{i}" for i in range(4)]

_op = st.one_of(
    st.tuples(
        st.just("pod"),
        st.sampled_from(_POD_NAMES),
        st.lists(st.sampled_from(_CLAIM_NAMES), min_size=1, max_size=2, unique=True),
        st.integers(0, 2),
    ),
    st.tuples(st.just("claim"), st.sampled_from(_CLAIM_NAMES)),
    st.tuples(st.just("delete-claim"), st.sampled_from(_CLAIM_NAMES)),
    st.tuples(st.just("clear"), st.sampled_from(_CLAIM_NAMES)),  # kube-scheduler's PostFilter
    st.tuples(st.just("end"), st.sampled_from(_POD_NAMES)),
    st.tuples(st.just("delete-pod"), st.sampled_from(_POD_NAMES)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 5.0, 31.0])),
    st.tuples(st.just("step")),
)


def _apply(h: Harness, op: tuple[Any, ...]) -> None:
    kind = op[0]
    objects = h.writer.objects
    if kind == "pod" and op[1] not in objects:
        h.add(Kind.POD, pod(op[1], op[2], priority=op[3]))
    elif kind == "claim" and op[1] not in objects:
        h.add(Kind.CLAIM, claim(op[1]))
    elif kind in ("delete-claim", "delete-pod") and op[1] in objects:
        gone = objects.pop(op[1])
        h.rec.enqueue(
            Kind.CLAIM if kind == "delete-claim" else Kind.POD,
            EventType.DELETED,
            gone,
        )
    elif kind == "clear" and op[1] in objects and objects[op[1]]["status"].get("allocation"):
        c = h.current(op[1])
        c["status"].pop("allocation")
        h.update(Kind.CLAIM, c)
    elif kind == "end" and op[1] in objects:
        p = h.current(op[1])
        p["status"]["phase"] = "Succeeded"
        h.update(Kind.POD, p)
    elif kind == "tick":
        h.now[0] += op[1]
    elif kind == "step":
        h.step()


def _fingerprint(w: PodWork) -> tuple[Any, ...]:
    claims = tuple((key_of(c), c["metadata"].get("resourceVersion")) for c in w.claims)
    return (w.kind, w.reason, w.message, claims)


def _assert_classifications_current(h: Harness) -> None:
    rec = h.rec
    rec.pending()  # classifies what changed since the last pass, as the next pass would
    kept = {key: q.work for key, q in rec._memory.queue.ordered()}
    candidates = set(rec._memory.candidates())
    stores = rec.stores
    for key in candidates:
        fresh = pod_work(stores[Kind.POD][key], stores[Kind.CLAIM], rec._cfg.classes)
        if fresh.kind is WorkKind.NONE:
            assert key not in kept, f"{key} needs nothing but is still queued"
        else:
            assert key in kept, f"{key} needs {fresh.kind} but is not queued"
            assert _fingerprint(kept[key]) == _fingerprint(fresh), key
    assert set(kept) <= candidates


@given(st.lists(_op, max_size=40))
@settings(max_examples=150, deadline=None)
def test_no_pod_is_forgotten(ops: list[tuple[Any, ...]]) -> None:
    h = Harness(nodes={"n1": 2})
    for op in ops:
        _apply(h, op)
        if op[0] == "step":
            _assert_classifications_current(h)
    # Long after every retry time (backoffs stay under 60 s), one pass must have tried every
    # pod that can be placed: placed it, or set its next retry after this moment.
    h.now[0] += 1000
    moment = h.now[0]
    h.step()
    h.step()
    _assert_classifications_current(h)
    for key, q in h.rec._memory.queue.ordered():
        state = h.rec._memory.wait_of(key)
        if q.work.kind is WorkKind.PLACE:
            assert state is not None, f"{key} is placeable and has no state"
            assert state.permanent or state.retry_at > moment, f"{key} was not tried"
