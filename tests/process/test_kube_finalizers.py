"""process.kube.finalizers, the one way both programs write finalizers: each write names only
its own entry, so another party's entry written meanwhile is never dropped, and none carries a
resourceVersion, so an unrelated write never makes it conflict. Against `VersionedStore`
(tests/support/patch_store.py); the real apiserver judges the same patches in the cluster
suites and tests/deploy/test_least_privilege.py."""

from __future__ import annotations

import pytest

from driver.apiobject import Obj
from process.kube.errors import api_error
from process.kube.finalizers import FinalizedObject, add_finalizer, remove_finalizer
from process.kube.rmw import ObjectReplacedError, WriteFencedError, WriteSkippedError
from tests.support.patch_store import VersionedStore

PATH = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"
MINE, THEIRS = "carve.example/node-a", "example.com/theirs"
SMP, JSON = "application/strategic-merge-patch+json", "application/json-patch+json"


def _store(*finalizers: str) -> tuple[VersionedStore, Obj]:
    store = VersionedStore()
    meta = {"name": "c", "namespace": "ns", "uid": "u1", "finalizers": list(finalizers)}
    return store, store.add({"metadata": meta, "status": {}})


def _obj(store: VersionedStore, **kw: object) -> FinalizedObject:
    return FinalizedObject(store, PATH, "ns", "c", "u1", **kw)  # type: ignore[arg-type]


def _others_write(store: VersionedStore, finalizers: list[str]) -> None:
    store.before_put = lambda cur: store.add(
        {**cur, "metadata": {**cur["metadata"], "finalizers": finalizers}}
    )


def test_an_add_keeps_what_another_party_wrote_since_the_copy() -> None:
    store, copy_ = _store()
    _others_write(store, [THEIRS])
    out = add_finalizer(_obj(store), MINE, current=copy_)
    assert out["metadata"]["finalizers"] == [MINE, THEIRS]  # as the apiserver orders them
    assert store.kinds == [SMP], "one request: no resourceVersion to go stale, no read"


def test_an_add_of_a_finalizer_the_copy_has_costs_no_request() -> None:
    store, copy_ = _store(MINE)
    assert add_finalizer(_obj(store), MINE, current=copy_) is copy_
    assert store.puts == 0


def test_an_add_to_an_object_being_deleted_or_replaced_says_so() -> None:
    store, _ = _store()
    store.objs[("ns", "c")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    with pytest.raises(WriteSkippedError, match="being deleted"):
        add_finalizer(_obj(store), MINE)  # refused by the apiserver (422), then read
    store.objs[("ns", "c")]["metadata"]["uid"] = "u2"
    with pytest.raises(ObjectReplacedError):
        add_finalizer(_obj(store), MINE)


def test_a_removal_keeps_an_entry_added_before_it_and_finds_its_own_again() -> None:
    store, copy_ = _store(MINE)
    _others_write(store, [THEIRS, MINE])  # its index moved from 0 to 1
    out = remove_finalizer(_obj(store), MINE, current=copy_)
    assert out["metadata"]["finalizers"] == [THEIRS]
    assert store.kinds == [JSON, JSON], "the test at index 0 failed (422); read; removed at 1"


def test_a_removal_of_an_absent_finalizer_reads_and_writes_nothing_more() -> None:
    store, _ = _store(THEIRS)
    assert remove_finalizer(_obj(store), MINE)["metadata"]["finalizers"] == [THEIRS]
    assert store.puts == 0


def test_a_transient_error_is_retried_and_the_fence_stops_every_write() -> None:
    store, copy_ = _store(MINE)
    failures = [api_error(503, "unavailable")]
    original = store.request

    def flaky(method: str, path: str, **kw: object) -> Obj:
        if method == "PATCH" and failures:
            raise failures.pop()
        return original(method, path, **kw)  # type: ignore[arg-type]

    store.request = flaky  # type: ignore[method-assign]
    out = remove_finalizer(_obj(store), MINE, current=copy_, sleep=lambda _: None)
    assert out["metadata"]["finalizers"] == []
    puts = store.puts
    with pytest.raises(WriteFencedError):
        add_finalizer(_obj(store, fence=lambda: False), MINE, current=out)
    with pytest.raises(WriteFencedError):
        remove_finalizer(
            _obj(store, fence=lambda: False),
            THEIRS,
            current={**out, "metadata": {**out["metadata"], "finalizers": [THEIRS]}},
        )
    assert store.puts == puts
