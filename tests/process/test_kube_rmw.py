"""read_modify_write against a minimal optimistic-concurrency store (409 on a stale version).

The controller's writer (tests/controller/test_status.py, and cluster/ against the real
apiserver) and the plugin's slice publisher exercise the same helper through their own clients;
its pinned JSON patch form, `edit_pinned`, is tested through `process.kube.finalizers`
(tests/process/test_kube_finalizers.py) and the controller's gate removal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from driver.apiobject import Obj
from process.kube.rmw import (
    ObjectGoneError,
    ObjectReplacedError,
    RetryPolicy,
    Target,
    WriteFencedError,
    WriteSkippedError,
    read_modify_write,
)


class HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class Store:
    """One object; writes replace `data` when they carry the current resourceVersion."""

    def __init__(self) -> None:
        self.obj: Obj | None = {"metadata": {"name": "o", "uid": "u1", "resourceVersion": "1"}}
        self.writes: list[Obj] = []
        self.fail_next: list[int] = []  # statuses the next writes answer with
        self.before_write: Callable[[], None] | None = None

    def bump(self, **data: Any) -> None:
        assert self.obj is not None
        self.obj = {**self.obj, **data}
        self.obj["metadata"] = {
            **self.obj["metadata"],
            "resourceVersion": str(int(self.obj["metadata"]["resourceVersion"]) + 1),
        }

    def read(self) -> Obj:
        if self.obj is None:
            raise HttpError(404)
        return copy.deepcopy(self.obj)

    def write(self, body: Obj) -> Obj:
        self.writes.append(copy.deepcopy(body))
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            hook()
        if self.fail_next:
            raise HttpError(self.fail_next.pop(0))
        if self.obj is None:
            raise HttpError(404)
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise HttpError(409)
        self.bump(data=body["data"])
        return copy.deepcopy(self.obj)

    def target(self) -> Target:
        return Target("ns", "o", "u1", self.read, self.write)


def _append(item: str) -> Callable[[Obj], Obj | None]:
    def mutate(cur: Obj) -> Obj | None:
        data = list(cur.get("data") or [])
        return None if item in data else {"data": [*data, item]}

    return mutate


def _rmw(store: Store, mutate: Callable[[Obj], Obj | None], **kw: Any) -> Obj:
    sleeps: list[float] = []
    out = read_modify_write(store.target(), mutate, sleep=sleeps.append, **kw)
    assert all(0 <= s <= 2.0 for s in sleeps)
    return out


def test_reads_first_without_a_copy_and_writes_with_its_version() -> None:
    store = Store()
    out = _rmw(store, _append("a"))
    assert out["data"] == ["a"]
    assert store.writes == [{"data": ["a"], "metadata": {"resourceVersion": "1"}}]


def test_conflict_rederives_from_the_fresh_copy() -> None:
    store = Store()
    stale = store.read()
    store.bump(data=["other"])
    out = _rmw(store, _append("a"), current=stale)
    assert out["data"] == ["other", "a"]  # the other writer's item survives
    assert [w["metadata"]["resourceVersion"] for w in store.writes] == ["1", "2"]


def test_nothing_to_write_writes_nothing() -> None:
    store = Store()
    store.bump(data=["a"])
    assert _rmw(store, _append("a"))["data"] == ["a"]
    assert store.writes == []


def test_a_skip_on_a_handed_in_copy_is_judged_again_on_a_fresh_read() -> None:
    store = Store()
    stale = store.read()
    stale["deleting"] = True  # what an old cache entry said

    def unless_deleting(cur: Obj) -> Obj | None:
        if cur.get("deleting"):
            raise WriteSkippedError("being deleted")
        return {"data": ["a"]}

    assert _rmw(store, unless_deleting, current=stale)["data"] == ["a"]
    store.bump(deleting=True)
    with pytest.raises(WriteSkippedError, match="being deleted"):
        _rmw(store, unless_deleting)


def test_gone_and_replaced_are_told_apart() -> None:
    store = Store()
    copy_ = store.read()
    store.obj = None
    with pytest.raises(ObjectGoneError, match="ns/o was deleted"):
        _rmw(store, _append("a"), current=copy_)
    with pytest.raises(ObjectGoneError, match="ns/o was deleted"):
        _rmw(store, _append("a"))
    store.obj = {"metadata": {"name": "o", "uid": "u2", "resourceVersion": "9"}}
    with pytest.raises(ObjectReplacedError, match="replaced"):
        _rmw(store, _append("a"), current=copy_)
    assert all(w["metadata"]["resourceVersion"] == "1" for w in store.writes)


def test_the_fence_is_asked_before_every_attempt() -> None:
    store = Store()
    with pytest.raises(WriteFencedError, match="leader"):
        _rmw(store, _append("a"), fence=lambda: False)
    assert store.writes == []
    leading = [True]

    def lose_the_lease() -> None:
        leading[0] = False
        store.bump()

    store.before_write = lose_the_lease
    with pytest.raises(WriteFencedError):
        _rmw(store, _append("a"), fence=lambda: leading[0])
    assert len(store.writes) == 1  # the conflict was not retried by a fenced writer


def test_transient_errors_are_retried_and_attempts_are_bounded() -> None:
    store = Store()
    store.fail_next = [503, 429]
    assert _rmw(store, _append("a"))["data"] == ["a"]
    assert len(store.writes) == 3
    store.fail_next = [500] * 10
    with pytest.raises(HttpError) as err:
        _rmw(store, _append("b"), policy=RetryPolicy(attempts=4))
    assert err.value.status == 500 and len(store.writes) == 3 + 4


def test_a_client_error_is_not_retried() -> None:
    store = Store()
    store.fail_next = [422]
    with pytest.raises(HttpError):
        _rmw(store, _append("a"))
    assert len(store.writes) == 1
