"""KubeClaimWriter: allocation shape, optimistic-concurrency retries, and skip rules.

`VersionedStore` (tests/support/patch_store.py) is a minimal stand-in for the apiserver's patches
behind the JSON client's `request`, which KubeClaimWriter calls.
The same writer is exercised against the real kube-apiserver in tests/controller/cluster/.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from controller.objects import ClaimAllocation
from controller.status import (
    KubeClaimWriter,
    ObjectGoneError,
    WriteSkippedError,
    build_allocation_status,
    node_selector_for,
)
from driver.allocation import AllocatedDevice
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER
from process.kube.errors import ConflictError
from tests.support.patch_store import VersionedStore

ALLOCATION_FINALIZER = DEFAULT_CONTRACT.allocation_finalizer
SCHEDULING_GATE = DEFAULT_CONTRACT.scheduling_gate

NOW = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)


def _claim(**extra: Any) -> Obj:
    c: Obj = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u1", "finalizers": []},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "mig.carve.dev",
                            "tolerations": [{"key": "k", "operator": "Exists"}],
                        },
                    },
                    {
                        "name": "alt",
                        "firstAvailable": [
                            {"name": "big", "deviceClassName": "mig.carve.dev"},
                            {"name": "small", "deviceClassName": "1g.mig.carve.dev"},
                        ],
                    },
                ],
                "config": [
                    {"requests": ["gpu"], "opaque": {"driver": "mig.carve.dev", "parameters": {}}}
                ],
            }
        },
        "status": {},
    }
    c.update(extra)
    return c


ALLOC = ClaimAllocation(
    "ns",
    "c",
    "u1",
    "node-a",
    (
        AllocatedDevice("gpu", "mig.carve.dev", "node-a", "gpu-0-3g-40gb-4", profile="3g.40gb"),
        AllocatedDevice(
            "alt/small", "mig.carve.dev", "node-a", "gpu-0-1g-10gb-0", profile="1g.10gb"
        ),
    ),
)
CLASSES = {
    "1g.mig.carve.dev": {
        "metadata": {"name": "1g.mig.carve.dev"},
        "spec": {"config": [{"opaque": {"driver": "mig.carve.dev", "parameters": {"a": 1}}}]},
    }
}


def test_allocation_status_shape() -> None:
    status = build_allocation_status(_claim(), ALLOC, CLASSES, NOW)
    assert status["nodeSelector"] == node_selector_for("node-a")
    assert status["allocationTimestamp"] == "2026-03-01T12:00:00Z"
    results = status["devices"]["results"]
    assert [(r["request"], r["device"]) for r in results] == [
        ("gpu", "gpu-0-3g-40gb-4"),
        ("alt/small", "gpu-0-1g-10gb-0"),
    ]
    assert results[0]["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert "tolerations" not in results[1]
    assert status["devices"]["config"] == [
        {
            "source": "FromClass",
            "requests": ["alt/small"],
            "opaque": {"driver": "mig.carve.dev", "parameters": {"a": 1}},
        },
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {"driver": "mig.carve.dev", "parameters": {}},
        },
    ]


def _writer(store: VersionedStore, **kw: Any) -> KubeClaimWriter:
    return KubeClaimWriter(store, clock=lambda: NOW, **kw)


def test_conflict_is_retried_on_the_fresh_object() -> None:
    store = VersionedStore()
    w = _writer(store)
    c = w.add_finalizer(store.add(_claim()))
    puts = store.puts

    def someone_else_adds_a_finalizer(cur: Obj) -> None:
        cur["metadata"]["finalizers"].append("example.com/other")
        store.add(cur)

    store.before_put = someone_else_adds_a_finalizer
    out = w.write_allocation(c, ALLOC, CLASSES)
    assert out["metadata"]["finalizers"] == [ALLOCATION_FINALIZER, "example.com/other"]
    assert out["status"]["allocation"]
    assert store.puts - puts == 2, "the allocation is guarded: 409, read, written again"


def test_finalizer_and_gate_edits_need_no_resource_version_and_never_conflict() -> None:
    """kube-controller-manager writing a pod (its claims in the status) as carve ungates it
    used to cost a 409, a GET and a second PATCH; a JSON patch pinned by `test` does not."""
    store = VersionedStore()
    pod = store.add(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "pu"},
            "spec": {"schedulingGates": [{"name": SCHEDULING_GATE}]},
        }
    )
    store.before_put = lambda cur: store.add({**cur, "status": {"resourceClaimStatuses": []}})
    out = _writer(store).remove_gate(pod)
    assert out["spec"]["schedulingGates"] == []
    assert store.kinds == ["application/json-patch+json"], "one request, no GET, no retry"

    claim = store.add(_claim())
    store.before_put = lambda cur: store.add(
        {**cur, "metadata": {**cur["metadata"], "finalizers": ["example.com/other"]}}
    )
    out = _writer(store).add_finalizer(claim)
    assert out["metadata"]["finalizers"] == [ALLOCATION_FINALIZER, "example.com/other"]
    assert store.kinds[1:] == ["application/strategic-merge-patch+json"]


def test_the_finalizer_the_admission_policy_added_costs_no_request() -> None:
    store = VersionedStore()
    c = store.add(_claim())
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    assert _writer(store).add_finalizer(c) is c
    assert store.puts == 0


def test_a_removal_whose_list_moved_reads_once_and_removes_at_the_new_index() -> None:
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = ["example.com/a", ALLOCATION_FINALIZER]
    c = store.add(c)
    store.before_put = lambda cur: store.add(
        {**cur, "metadata": {**cur["metadata"], "finalizers": [ALLOCATION_FINALIZER]}}
    )
    out = _writer(store).remove_finalizer(c)
    assert out["metadata"]["finalizers"] == []
    assert store.puts == 2, "the test at index 1 failed (422); read, removed at index 0"


def test_a_removal_on_a_namesake_is_refused_by_its_uid() -> None:
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    c = store.add(c)
    store.add({**c, "metadata": {**c["metadata"], "uid": "u2"}})
    with pytest.raises(ObjectGoneError, match="replaced"):
        _writer(store).remove_finalizer(c)
    assert store.objs[("ns", "c")]["metadata"]["finalizers"] == [ALLOCATION_FINALIZER]


def test_allocation_requires_our_finalizer_and_skips_foreign_allocation() -> None:
    store = VersionedStore()
    w = _writer(store)
    c = store.add(_claim())
    with pytest.raises(WriteSkippedError, match="finalizer"):
        w.write_allocation(c, ALLOC, CLASSES)
    c = w.add_finalizer(c)

    def scheduler_allocates(cur: Obj) -> None:
        cur["status"]["allocation"] = {"devices": {"results": [{"device": "x"}]}}
        store.add(cur)

    store.before_put = scheduler_allocates
    with pytest.raises(WriteSkippedError, match="someone else"):
        w.write_allocation(c, ALLOC, CLASSES)


def test_lost_response_retry_recognises_own_allocation() -> None:
    store = VersionedStore()
    w = _writer(store)
    c = w.add_finalizer(store.add(_claim()))
    done = w.write_allocation(c, ALLOC, CLASSES)
    # Retrying with the pre-write copy: 409, re-read, sees our allocation, no further write.
    again = w.write_allocation(c, ALLOC, CLASSES)
    assert again["status"] == done["status"]


def test_deleted_claim_is_reported_as_gone() -> None:
    store = VersionedStore()
    c = store.add(_claim())
    del store.objs[("ns", "c")]
    with pytest.raises(ObjectGoneError):
        _writer(store).add_finalizer(c)


def test_replaced_claim_with_new_uid_is_gone() -> None:
    store = VersionedStore()
    c = store.add(_claim())
    replacement = _claim()
    replacement["metadata"]["uid"] = "u2"
    store.add(replacement)
    with pytest.raises(ObjectGoneError, match="replaced"):
        _writer(store).add_finalizer(c)


def test_clear_refuses_reserved_claim() -> None:
    store = VersionedStore()
    c = _claim()
    c["status"] = {"allocation": {"x": 1}, "reservedFor": [{"name": "p"}]}
    with pytest.raises(WriteSkippedError, match="reserved"):
        _writer(store).clear_allocation(store.add(c))


def test_clear_refuses_a_claim_a_node_prepared_meanwhile() -> None:
    """The release was decided on a cached copy without a node finalizer; the node's plugin
    adds its finalizer (it is preparing the claim) before the clear lands, so the clear gets
    409. The retry must see the finalizer and stop: clearing would free a placement whose MIG
    instance the node is about to make (invariant 4; seen in tests/e2e/test_two_allocators.py
    as an instance no allocated claim named)."""
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    c["status"] = {"allocation": {"x": 1}}
    cached = store.add(c)

    def node_prepares(cur: Obj) -> None:
        cur["metadata"]["finalizers"].append(DEFAULT_CONTRACT.node_finalizer("n1"))
        store.add(cur)

    store.before_put = node_prepares
    with pytest.raises(WriteSkippedError, match="node"):
        _writer(store).clear_allocation(cached)
    assert store.objs[("ns", "c")]["status"]["allocation"] == {"x": 1}


def test_fenced_writer_writes_nothing() -> None:
    store = VersionedStore()
    c = store.add(_claim())
    with pytest.raises(WriteSkippedError, match="leader"):
        _writer(store, fence=lambda: False).add_finalizer(c)
    assert store.puts == 0


def test_remove_gate_keeps_other_gates() -> None:
    store = VersionedStore()
    pod = store.add(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "pu"},
            "spec": {"schedulingGates": [{"name": "other/gate"}, {"name": SCHEDULING_GATE}]},
        }
    )
    out = _writer(store).remove_gate(pod)
    assert out["spec"]["schedulingGates"] == [{"name": "other/gate"}]


def test_conflict_storm_gives_up_after_bounded_attempts() -> None:
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    c = store.add(c)

    calls = {"n": 0}
    original = store._patch

    def always_conflict(name: str, ns: str, body: Any, status: bool, content_type: str) -> Obj:
        calls["n"] += 1
        store.add(store.objs[(ns, name)])  # bump resourceVersion under the writer's feet
        return original(name, ns, body, status, content_type)

    store._patch = always_conflict  # type: ignore[method-assign]
    with pytest.raises(ConflictError):
        _writer(store, attempts=4).write_allocation(c, ALLOC, CLASSES)
    assert calls["n"] == 4


def test_the_pod_condition_is_one_strategic_merge_of_the_pods_status() -> None:
    """Keyed by condition type: it neither races with the kubelet's or the scheduler's own
    conditions nor needs a resourceVersion."""
    seen: list[tuple[str, str, Any, str]] = []

    class Api:
        def request(self, method: str, path: str, **kw: Any) -> Obj:
            seen.append((method, path, kw["body"], kw["content_type"]))
            return {}

    writer = KubeClaimWriter(Api())
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
    writer.set_pod_condition(pod, True, "Placed", "placed on n1")
    ((method, path, body, content_type),) = seen
    assert (method, path) == ("PATCH", "/api/v1/namespaces/ns/pods/p/status")
    assert content_type == "application/strategic-merge-patch+json"
    assert body["status"]["conditions"][0]["reason"] == "Placed"


def test_the_hand_over_is_one_json_patch_that_keeps_other_finalizers() -> None:
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = ["example.com/a", ALLOCATION_FINALIZER]
    c["metadata"]["annotations"] = {"example.com/note": "x"}
    out = _writer(store).hand_to_scheduler(store.add(c))
    assert out["metadata"]["finalizers"] == ["example.com/a"]
    assert out["metadata"]["annotations"] == {
        "example.com/note": "x",
        DEFAULT_CONTRACT.allocator_annotation: HANDED_TO_SCHEDULER,
    }
    assert store.kinds == ["application/json-patch+json"]
    assert _writer(store).hand_to_scheduler(out) is out, "handed over already: no request"


def test_a_claim_allocated_before_the_hand_over_lands_is_not_handed_over() -> None:
    """The patch tests the resourceVersion it was derived from: a write in between (here an
    allocation) fails it, and the fresh copy says the hand-over no longer applies."""
    store = VersionedStore()
    c = _claim()
    c["metadata"]["finalizers"] = [ALLOCATION_FINALIZER]
    cached = store.add(c)

    def allocated(cur: Obj) -> None:
        cur["status"] = {"allocation": {"x": 1}}
        store.add(cur)

    store.before_put = allocated
    with pytest.raises(WriteSkippedError, match="allocated"):
        _writer(store).hand_to_scheduler(cached)
    kept = store.objs[("ns", "c")]["metadata"]
    assert kept["finalizers"] == [ALLOCATION_FINALIZER] and "annotations" not in kept
