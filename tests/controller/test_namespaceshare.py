"""The namespace share (controller/namespaceshare.py, issue 41.5): a namespace's waiting pods
past its share are shed, not lost; each is taken up in turn, with its claims, through the real
informers' transforms and the real `Informer.refresh`. Against a real apiserver:
tests/bench/test_flood.py."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.informers import standard_informers
from controller.namespaceshare import (
    EVENT_BURST,
    EVENT_EVERY_S,
    SHED_REASON,
    NamespaceShare,
    Refetcher,
    ShedReport,
)
from controller.objects import EventType, Kind
from driver.contract import DEFAULT_CONTRACT
from process.kube import Obj
from process.kube.errors import NotFoundError
from tests.support.fake_lists import EmptyLists

GATE = DEFAULT_CONTRACT.scheduling_gate
MIG = DEFAULT_CONTRACT.mig_class


def _pod(ns: str, name: str, rv: str = "1", **spec: Any) -> Obj:
    return {
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "uid": f"u-{name}", "resourceVersion": rv},
        "spec": {
            "schedulingGates": [{"name": GATE}],
            "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "slice-1g"}],
            "containers": [{"name": "c"}],
            **spec,
        },
    }


def _claim(ns: str, name: str, owner: str) -> Obj:
    return {
        "kind": "ResourceClaim",
        "metadata": {
            "namespace": ns,
            "name": name,
            "uid": f"u-{name}",
            "resourceVersion": "1",
            "ownerReferences": [{"kind": "Pod", "name": owner, "uid": "x", "controller": True}],
        },
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": {"deviceClassName": MIG}}]}},
    }


class _Cluster:
    """The controller's real pod and claim informers (fed by hand, as their watch would), the
    share, and a Refetcher whose reads answer from `server`."""

    def __init__(self, limit: int) -> None:
        self.share = NamespaceShare(limit)
        self.seen: list[tuple[Kind, EventType, str]] = []
        self.server: dict[tuple[Kind, str], Obj] = {}
        informers = standard_informers(
            EmptyLists(),
            lambda kind, type_, obj: self.seen.append(
                (kind, type_, f"{obj['metadata']['namespace']}/{obj['metadata']['name']}")
            ),
            lambda _k: None,
            share=self.share,
        )
        self.inf = {i.kind: i for i in informers}
        self.refetcher = Refetcher(self.share, self._read, self._deliver)

    def _read(self, kind: Kind, key: str) -> Obj:
        try:
            return self.server[(kind, key)]
        except KeyError:
            raise NotFoundError(404, f"{key} not found") from None

    def _deliver(self, kind: Kind, obj: Obj) -> bool:
        return self.inf[kind].refresh(obj, lambda k: self.share.wants(kind, k))

    def create(self, kind: Kind, obj: Obj) -> None:
        key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
        self.server[(kind, key)] = obj
        self.inf[kind].changed("ADDED", dict(obj))

    def delete(self, kind: Kind, key: str) -> None:
        obj = self.server.pop((kind, key))
        self.inf[kind].changed("DELETED", dict(obj))

    def bind(self, key: str) -> None:
        pod = dict(self.server[(Kind.POD, key)])
        pod["spec"] = {**pod["spec"], "nodeName": "n1", "schedulingGates": []}
        self.server[(Kind.POD, key)] = pod
        self.inf[Kind.POD].changed("MODIFIED", dict(pod))

    def cached(self, kind: Kind) -> set[str]:
        return set(self.inf[kind].cache)


def test_pods_past_a_namespaces_share_are_shed_and_another_namespace_is_untouched() -> None:
    c = _Cluster(limit=2)
    for i in range(4):
        c.create(Kind.POD, _pod("flood", f"p{i}"))
    c.create(Kind.POD, _pod("tenant", "t0"))
    assert c.cached(Kind.POD) == {"flood/p0", "flood/p1", "tenant/t0"}
    assert c.share.shed_now() == {"flood": 2}
    assert [p.name for p in c.share.take_newly_shed()] == ["p2", "p3"]
    # A claim made for a shed pod is shed with it; one made for a kept pod is kept.
    c.create(Kind.CLAIM, _claim("flood", "p2-mig", owner="p2"))
    c.create(Kind.CLAIM, _claim("flood", "p0-mig", owner="p0"))
    assert c.cached(Kind.CLAIM) == {"flood/p0-mig"}


def test_a_placed_pod_gives_its_room_to_the_oldest_shed_pod_with_its_claims() -> None:
    c = _Cluster(limit=2)
    for i in range(4):
        c.create(Kind.POD, _pod("flood", f"p{i}"))
    c.create(Kind.CLAIM, _claim("flood", "p2-mig", owner="p2"))
    c.bind("flood/p0")  # placed: no longer waiting
    assert c.share.take_reads() == [(Kind.POD, "flood/p2"), (Kind.CLAIM, "flood/p2-mig")]
    assert c.refetcher.read_once(0.0) == 2
    assert {"flood/p1", "flood/p2"} <= c.cached(Kind.POD)
    assert "flood/p2-mig" in c.cached(Kind.CLAIM)
    assert (Kind.POD, EventType.ADDED, "flood/p2") in c.seen
    assert c.share.shed_now() == {"flood": 1} and c.share.take_reads() == []
    c.delete(Kind.POD, "flood/p1")  # deleted: its room goes to p3
    assert c.refetcher.read_once(0.0) == 1
    assert "flood/p3" in c.cached(Kind.POD) and c.share.shed_now() == {}


def test_a_pod_deleted_before_its_read_is_delivered_is_not_brought_back() -> None:
    """The read and the watch race: the watch's deletion wins, whichever answered first."""
    c = _Cluster(limit=1)
    c.create(Kind.POD, _pod("flood", "p0"))
    c.create(Kind.POD, _pod("flood", "p1"))
    c.bind("flood/p0")
    stale = c.server[(Kind.POD, "flood/p1")]
    c.delete(Kind.POD, "flood/p1")  # deleted after it was read, before it was delivered
    assert not c.inf[Kind.POD].refresh(stale, lambda k: c.share.wants(Kind.POD, k))
    assert "flood/p1" not in c.cached(Kind.POD)
    assert (Kind.POD, EventType.ADDED, "flood/p1") not in c.seen


def test_a_shed_pod_gone_from_the_server_frees_its_room() -> None:
    c = _Cluster(limit=1)
    for i in range(3):
        c.create(Kind.POD, _pod("flood", f"p{i}"))
    del c.server[(Kind.POD, "flood/p1")]  # deleted while the watch was away
    c.bind("flood/p0")
    c.refetcher.read_once(0.0)  # p1: 404, so its room goes on to p2
    c.refetcher.read_once(0.0)
    assert "flood/p2" in c.cached(Kind.POD)


def test_allocated_claims_and_claims_being_deleted_are_never_shed() -> None:
    c = _Cluster(limit=1)
    c.create(Kind.POD, _pod("flood", "p0"))
    c.create(Kind.POD, _pod("flood", "p1"))
    deleting = _claim("flood", "p1-a", owner="p1")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    allocated = _claim("flood", "p1-b", owner="p1")
    allocated["status"] = {"allocation": {"devices": {"results": [{"driver": "x"}]}}}
    c.create(Kind.CLAIM, deleting)
    c.create(Kind.CLAIM, allocated)
    assert c.cached(Kind.CLAIM) == {"flood/p1-a", "flood/p1-b"}


def test_no_share_keeps_every_pod() -> None:
    c = _Cluster(limit=0)
    for i in range(50):
        c.create(Kind.POD, _pod("flood", f"p{i}"))
    assert len(c.cached(Kind.POD)) == 50 and c.share.shed_now() == {}


@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "place"]), st.sampled_from("ab"), st.integers(0, 7)),
        max_size=60,
    ),
    st.integers(1, 3),
)
@settings(max_examples=150, deadline=None)
def test_a_share_is_never_exceeded_and_shed_pods_come_back_in_arrival_order(
    ops: list[tuple[str, str, int]], limit: int
) -> None:
    c = _Cluster(limit)
    arrived: dict[str, list[str]] = {"a": [], "b": []}
    placed: set[str] = set()
    for op, ns, i in ops:
        key = f"{ns}/p{i}"
        if op == "add" and (Kind.POD, key) not in c.server and key not in placed:
            c.create(Kind.POD, _pod(ns, f"p{i}"))
            arrived[ns].append(key)
        elif op == "place" and key in c.cached(Kind.POD) and key not in placed:
            c.bind(key)
            placed.add(key)
        c.refetcher.read_once(0.0)
        waiting = {k for k in c.cached(Kind.POD) if k not in placed}
        for n in ("a", "b"):
            mine = [k for k in arrived[n] if k not in placed]
            kept = [k for k in mine if k in waiting]
            assert len(kept) == min(limit, len(mine))
            assert kept == mine[: len(kept)]  # the oldest are the ones kept


def test_shed_pods_are_evented_in_bursts_per_namespace_and_counted() -> None:
    share = NamespaceShare(1)
    events: list[tuple[str, str]] = []
    gauge: list[int] = []
    counted: list[int] = []
    now = [0.0]
    report = ShedReport(
        share,
        lambda obj, kind, type_, reason, message: events.append((obj["metadata"]["name"], reason)),
        gauge.append,
        counted.append,
        clock=lambda: now[0],
    )
    for i in range(EVENT_BURST + 11):
        share.admit(_pod("flood", f"p{i}"))
    share.admit(_pod("other", "o0"))
    share.admit(_pod("other", "o1"))
    report.report()
    assert gauge[-1] == EVENT_BURST + 11 and counted == [EVENT_BURST + 11]
    names = [n for n, _ in events]
    assert len(names) == EVENT_BURST + 1 and "o1" in names  # the other namespace has its own
    assert {r for _, r in events} == {SHED_REASON}
    share.admit(_pod("flood", "late"))
    report.report()
    assert len(events) == EVENT_BURST + 1  # no token left for flood yet
    now[0] += EVENT_EVERY_S
    share.admit(_pod("flood", "later"))
    report.report()
    assert events[-1] == ("later", SHED_REASON)
