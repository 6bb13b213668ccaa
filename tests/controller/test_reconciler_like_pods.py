"""Pods with the same request share a refusal (`EnginePlanner.plan`'s `told`): a full
cluster's queue of like pods costs one search per kind of request after each change, nothing
placed differs from searching for every pod, and each pod keeps its own message."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.objects import EventType, Kind
from controller.planner import EnginePlanner, _Shape
from tests.support.engine_cluster import DRIVER, Cluster, device_class, profile_claim

_ONE_GPU = {"n1": ["H100-SXM5-80GB"]}  # room for two 3g.40gb


def _searches(c: Cluster) -> list[str]:
    """The pods the engine searches for, by name, in order."""
    seen: list[str] = []
    place = c.planner.engine.place

    def counted(request: Any) -> Any:
        seen.append(request.pod.partition("/")[2])
        return place(request)

    c.planner.engine.place = counted  # type: ignore[method-assign]
    return seen


def _fill_then_queue(c: Cluster, waiting: int) -> tuple[list[str], list[str]]:
    running = [c.submit(profile_claim(f"run{i}", "3g.40gb")) for i in range(2)]
    c.rec.step()
    queued = [c.submit(profile_claim(f"q{i}", "3g.40gb")) for i in range(waiting)]
    c.rec.step()
    return running, queued


def test_like_pods_waiting_for_room_cost_one_search_per_change() -> None:
    c = Cluster(_ONE_GPU)
    running, queued = _fill_then_queue(c, 10)
    assert all(c.allocation(f"run{i}") for i in range(2))
    searches = _searches(c)
    c.finish(running[0])  # frees one 3g.40gb placement: the first in the queue gets it
    c.rec.step()
    c.rec.step()
    assert c.allocation("q0") is not None
    assert [c.allocation(f"q{i}") for i in range(1, 10)] == [None] * 9
    # q0 searched and placed; its commit changed the model, so q1 searched again and was
    # refused; q2..q9 share q1's refusal.
    assert searches == [queued[0], queued[1]]


def test_a_shared_refusal_keeps_each_pods_own_message() -> None:
    c = Cluster(_ONE_GPU)
    running, _ = _fill_then_queue(c, 4)
    c.finish(running[0])
    c.rec.step()
    c.rec.step()
    for i in range(1, 4):
        warnings = [e for e in c.events_of(f"q{i}") if e[1] == "Warning"]
        assert warnings, f"q{i} was told why it waits"
        assert all(f"ns/q{i} " in e[3] for e in warnings), warnings
        assert not any(f"ns/q{j} " in e[3] for e in warnings for j in range(4) if j != i)


def test_a_different_request_is_searched_for_itself() -> None:
    c = Cluster(_ONE_GPU)
    running, _ = _fill_then_queue(c, 3)
    other = c.submit(profile_claim("big", "7g.80gb"))
    c.rec.step()
    searches = _searches(c)
    c.finish(running[0])
    c.rec.step()
    c.rec.step()
    assert other in searches, "a 7g.80gb pod does not share a 3g.40gb pod's refusal"


def test_a_smaller_request_behind_a_refused_larger_one_is_still_placed() -> None:
    c = Cluster(_ONE_GPU)
    running, _ = _fill_then_queue(c, 0)
    c.submit(profile_claim("big", "7g.80gb"))
    c.submit(profile_claim("small", "1g.10gb"))
    c.rec.step()
    assert c.allocation("big") is None and c.allocation("small") is None  # both told to wait
    c.finish(running[0])
    c.rec.step()
    c.rec.step()
    assert c.allocation("big") is None
    assert c.allocation("small") is not None


def test_sharing_off_searches_for_every_pod() -> None:
    c = Cluster(_ONE_GPU, planner=EnginePlanner(DRIVER, shared_refusal_s=0))
    running, queued = _fill_then_queue(c, 6)
    searches = _searches(c)
    c.finish(running[0])
    c.rec.step()
    c.rec.step()
    assert searches[0] == queued[0]
    assert sorted(searches[1:]) == sorted(queued[1:])


_PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.sampled_from(_PROFILES), st.integers(0, 1)),
            st.tuples(st.just("finish"), st.integers(0, 30), st.just(0)),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_sharing_refusals_never_changes_what_is_placed(ops: list[tuple[str, object, int]]) -> None:
    """The same arrivals and ends, with and without sharing: the same claims allocated on the
    same devices after every step (the engine is deterministic; sharing only skips searches
    that would have been refused)."""
    nodes = {"n1": ["H100-SXM5-80GB", "A100-SXM4-40GB"], "n2": ["H100-SXM5-80GB"]}
    shared = Cluster(nodes)
    alone = Cluster(nodes, planner=EnginePlanner(DRIVER, shared_refusal_s=0))
    names: list[str] = []
    live: list[str] = []
    for n, (op, arg, prio) in enumerate(ops):
        for c in (shared, alone):
            if op == "submit":
                pod = c.submit(profile_claim(f"c{n}", str(arg)), prio=prio)
            elif live:
                c.finish(live[int(str(arg)) % len(live)])
            c.rec.step()
            c.rec.step()
        if op == "submit":
            names.append(f"c{n}")
            live.append(pod)
        elif live:
            live.pop(int(str(arg)) % len(live))
        assert [shared.allocation(x) for x in names] == [alone.allocation(x) for x in names]


def _reads(c: Cluster) -> list[str]:
    """The pods whose request the planner reads (parses) afresh, by name, in order."""
    seen: list[str] = []
    read = c.planner._request

    def counted(pod: Any, claims: Any) -> Any:
        seen.append(pod["metadata"]["name"])
        return read(pod, claims)

    c.planner._request = counted  # type: ignore[method-assign]
    return seen


def test_a_waiting_pods_request_is_read_again_only_when_it_or_a_class_changed() -> None:
    c = Cluster(_ONE_GPU)
    running, queued = _fill_then_queue(c, 3)
    reads = _reads(c)
    c.finish(running[0])
    c.rec.step()
    c.rec.step()
    assert reads == [], "nothing of the waiting pods changed: their requests are kept"
    # A new copy of a claim (as every watch event brings) is read again.
    q1 = c.writer.objects["q1"]
    q1["metadata"]["labels"] = {"touched": "yes"}
    c.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c.writer.put(q1))
    c.rec.step()
    assert reads == [queued[1]]
    # A DeviceClass change reads every request again: the class is part of it.
    reads.clear()
    c.rec.enqueue(Kind.CLASS, EventType.MODIFIED, device_class("mig.carve.dev", "mig"))
    c.rec.step()
    assert sorted(reads) == sorted(queued[1:])


def test_equal_shapes_become_one_object_and_unequal_ones_with_one_digest_do_not() -> None:
    """A like pod's shape is looked up by identity after the first (`_one_shape`); two unequal
    requests whose hashes collide must still be told apart."""
    planner = EnginePlanner()
    first, equal, other = _Shape(("a",), 7), _Shape(("a",), 7), _Shape(("b",), 7)
    assert planner._one_shape(first) is first
    assert planner._one_shape(equal) is first
    assert planner._one_shape(other) is other
    assert other != first and hash(other) == hash(first)
