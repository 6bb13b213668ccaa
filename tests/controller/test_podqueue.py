"""PodQueue: which waiting pods a pass visits, against a plain model of the same rules."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.podqueue import PodQueue, Queued


def _entry(prio: int, name: str, counted: bool = True) -> Queued[str]:
    return Queued(f"work-{name}", (-prio, "2026-01-01T00:00:00Z", name), counted)


def test_a_put_makes_the_pod_due_once_in_queue_order() -> None:
    q: PodQueue[str] = PodQueue()
    q.put("low", _entry(0, "low"))
    q.put("high", _entry(5, "high"))
    assert [k for k, _ in q.take_due(0.0)] == ["high", "low"]
    assert q.take_due(0.0) == []  # visited: due again only when something says so
    assert [k for k, _ in q.ordered()] == ["high", "low"]


def test_a_timer_wakes_its_pod_when_its_time_comes_and_the_earliest_timer_wins() -> None:
    q: PodQueue[str] = PodQueue()
    q.put("p", _entry(0, "p"))
    q.take_due(0.0)
    q.wake_at("p", 30.0)
    q.wake_at("p", 10.0)  # earlier: replaces
    q.wake_at("p", 20.0)  # later than the one set: ignored
    assert q.take_due(9.9) == []
    assert [k for k, _ in q.take_due(10.0)] == ["p"]
    assert q.take_due(100.0) == []  # the superseded timers fire nothing


def test_a_dropped_pod_is_never_due_and_its_timer_is_void() -> None:
    q: PodQueue[str] = PodQueue()
    q.put("p", _entry(0, "p"))
    q.wake_at("p", 5.0)
    q.drop("p")
    q.wake("p")  # a wake for a pod the queue does not hold is a no-op
    assert q.take_due(10.0) == []
    assert "p" not in q and len(q) == 0


def test_changed_pods_come_back_sorted_once_and_depth_counts_only_counted_entries() -> None:
    q: PodQueue[str] = PodQueue()
    q.changed("b")
    q.changed("a")
    q.changed("b")
    assert q.take_stale() == ["a", "b"]
    assert q.take_stale() == []
    q.put("a", _entry(0, "a", counted=True))
    q.put("b", _entry(0, "b", counted=False))
    assert q.depth == 1
    q.put("b", _entry(0, "b", counted=True))  # reclassified: now counts
    assert q.depth == 2
    q.drop("a")
    q.drop("a")
    assert q.depth == 1


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 4), st.integers(0, 3), st.booleans()),
        st.tuples(st.just("drop"), st.integers(0, 4)),
        st.tuples(st.just("wake"), st.integers(0, 4)),
        st.tuples(st.just("wake_at"), st.integers(0, 4), st.integers(0, 20)),
        st.tuples(st.just("take"), st.integers(0, 20)),
    ),
    max_size=60,
)


@given(_ops)
@settings(max_examples=200, deadline=None)
def test_the_queue_agrees_with_a_plain_model(ops: list[tuple[Any, ...]]) -> None:
    """Due = put or woken since the last take, or a timer of the held pod has come; the model
    keeps every timer and scans them all, the queue keeps only the earliest in a heap."""
    q: PodQueue[str] = PodQueue()
    held: dict[str, Queued[str]] = {}
    due: set[str] = set()
    timers: dict[str, float] = {}
    now = 0.0
    for op in ops:
        kind, key = op[0], f"p{op[1]}"
        if kind == "put":
            entry = _entry(op[2], key, op[3])
            q.put(key, entry)
            held[key] = entry
            due.add(key)
        elif kind == "drop":
            q.drop(key)
            held.pop(key, None)
            due.discard(key)
            timers.pop(key, None)
        elif kind == "wake":
            q.wake(key)
            if key in held:
                due.add(key)
        elif kind == "wake_at":
            when = now + op[2]
            q.wake_at(key, when)
            timers[key] = min(timers.get(key, when), when)
        else:
            now += op[1]
            for k, when in list(timers.items()):
                if when <= now:
                    del timers[k]
                    if k in held:
                        due.add(k)
            want = sorted(due, key=lambda k: held[k].order)
            due.clear()
            assert [k for k, _ in q.take_due(now)] == want
        assert q.depth == sum(e.counted for e in held.values())
        assert len(q) == len(held)


def _in(ns: str, name: str, prio: int = 0, created: str = "2026-01-01T00:00:00Z") -> Queued[str]:
    return Queued(f"work-{name}", (-prio, created, f"{ns}/{name}"), True)


def test_namespaces_take_turns_within_a_priority_and_priority_still_comes_first() -> None:
    """Issue 41.5: a namespace's backlog of old pods does not put another's new pod last."""
    q: PodQueue[str] = PodQueue()
    for i in range(5):
        q.put(f"flood/p{i}", _in("flood", f"p{i}", created=f"2026-01-01T00:00:0{i}Z"))
    q.put("tenant/new", _in("tenant", "new", created="2026-01-01T00:10:00Z"))
    q.put("tenant/newer", _in("tenant", "newer", created="2026-01-01T00:11:00Z"))
    q.put("other/urgent", _in("other", "urgent", prio=10, created="2026-01-01T01:00:00Z"))
    want = [
        "other/urgent",  # higher priority, however young
        "flood/p0", "tenant/new",  # each namespace's oldest
        "flood/p1", "tenant/newer",
        "flood/p2", "flood/p3", "flood/p4",  # oldest first within a namespace
    ]  # fmt: skip
    assert [k for k, _ in q.ordered()] == want
    assert [k for k, _ in q.take_due(0.0)] == want


def test_a_pass_past_its_limit_leaves_the_rest_due_for_the_next() -> None:
    q: PodQueue[str] = PodQueue()
    for i in range(5):
        q.put(f"ns/p{i}", _in("ns", f"p{i}", created=f"2026-01-01T00:00:0{i}Z"))
    assert [k for k, _ in q.take_due(0.0, limit=2)] == ["ns/p0", "ns/p1"]
    assert q.has_due
    q.put("tenant/new", _in("tenant", "new", created="2026-01-02T00:00:00Z"))
    assert [k for k, _ in q.take_due(0.0, limit=2)] == ["ns/p2", "tenant/new"]
    assert [k for k, _ in q.take_due(0.0, limit=2)] == ["ns/p3", "ns/p4"]
    assert not q.has_due and q.take_due(0.0) == []
