"""Adding and removing one finalizer: the one way both programs write an object's finalizers.

A claim's finalizer list has several writers: carve's admission policy and the controller (the
allocation finalizer), the node agent that prepares the claim (its node finalizer), the
controller again on a lost node's behalf, and other parties' controllers. A merge patch of
`metadata.finalizers` replaces the whole list: derived from a stale copy, it drops an entry
added since, unless it carries the resourceVersion, and then every unrelated write to the
object (kube-scheduler reserving the claim, a status update) costs a 409, a GET and a second
PATCH. So each write here names only its own entry and pins the object by its uid, never by
its resourceVersion:

- adding is a strategic merge `{"metadata": {"uid": ..., "finalizers": [f]}}`: ObjectMeta's
  finalizers merge as a set, so the apiserver adds `f` to the list it has now, whoever wrote
  it. A 422 means another object stands under the name (the uid is immutable) or the object is
  being deleted (no new finalizers then); the object is read once to say which;
- removing is a JSON patch (`rmw.edit_pinned`): `test` that `f` is at the index the copy in
  hand shows, `remove` it there. A failed test (the list moved) reads the object again and
  removes it at its new index.

The controller (`controller.status`) and the node agent (`kubeletplugin.claims`) both call
these. The chart's admission policies judge the result (which entries changed), not the patch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from driver.apiviews import ObjectView
from process.kube import Obj
from process.kube.errors import status_of
from process.kube.jsonclient import JsonRequests
from process.kube.rmw import (
    JSON_PATCH,
    Fence,
    ObjectGoneError,
    ObjectReplacedError,
    RetryPolicy,
    Target,
    WriteFencedError,
    WriteSkippedError,
    edit_pinned,
    is_transient,
)

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


def _always() -> bool:
    return True


_DEFAULT_POLICY = RetryPolicy()  # frozen, so one shared default is safe


@dataclass(frozen=True)
class FinalizedObject:
    """The one object whose finalizers change: where the API serves it and which one it is."""

    api: JsonRequests
    path: str
    namespace: str
    name: str
    uid: str
    fence: Fence = _always
    policy: RetryPolicy = _DEFAULT_POLICY


def _target(obj: FinalizedObject, content_type: str) -> Target:
    return Target(
        namespace=obj.namespace,
        name=obj.name,
        uid=obj.uid,
        read=lambda: obj.api.request("GET", obj.path),
        write=lambda body: obj.api.request("PATCH", obj.path, body=body, content_type=content_type),
    )


def add_finalizer(
    obj: FinalizedObject,
    finalizer: str,
    *,
    current: Obj | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Obj:
    """Add `finalizer` (see the module docstring); returns the object as written. A copy in
    hand (`current`) that has it already costs no request, and one being deleted is refused
    (`WriteSkippedError`) without one."""
    if current is not None:
        view = ObjectView(current)
        if view.has_finalizer(finalizer):
            return current
        if view.deleting:
            raise WriteSkippedError(f"{obj.namespace}/{obj.name} is being deleted")
    target = _target(obj, STRATEGIC_MERGE)
    body = {"metadata": {"uid": obj.uid, "finalizers": [finalizer]}}

    def once() -> Obj:
        if not obj.fence():
            raise WriteFencedError("not the leader any more")
        try:
            return target.write(body)
        except Exception as exc:
            if status_of(exc) == 404:
                raise ObjectGoneError(f"{target.key} was deleted") from exc
            if status_of(exc) == 422:
                _why_refused(target, exc)
            raise

    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(obj.policy.attempts),
        wait=wait_random_exponential(multiplier=obj.policy.initial_s, max=obj.policy.max_wait_s),
        sleep=sleep,
        reraise=True,
    )
    result: Obj = retrying(once)
    return result


def _why_refused(target: Target, exc: Exception) -> None:
    """Raise what a refused add means: a namesake stands there, or the object is going."""
    try:
        fresh = target.read()
    except Exception as read_exc:
        if status_of(read_exc) == 404:
            raise ObjectGoneError(f"{target.key} was deleted") from exc
        raise
    view = ObjectView(fresh)
    if view.uid != target.uid:
        raise ObjectReplacedError(f"object was replaced (uid {target.uid} is gone)") from exc
    if view.deleting:
        raise WriteSkippedError(f"{target.key} is being deleted") from exc


def remove_finalizer(
    obj: FinalizedObject,
    finalizer: str,
    *,
    current: Obj | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Obj:
    """Remove `finalizer` (see the module docstring), derived from `current` if given, else
    from a fresh read; returns the object as written, or as read when it does not carry it."""
    return edit_pinned(
        _target(obj, JSON_PATCH),
        lambda cur: removal(cur, finalizer),
        current=current,
        fence=obj.fence,
        policy=obj.policy,
        sleep=sleep,
    )


def removal(obj: Obj, finalizer: str) -> list[Obj] | None:
    """The JSON patch operations that remove `finalizer` at the index `obj` shows it, tested
    there first; None when `obj` does not carry it. For a write that removes a finalizer along
    with other changes (`controller.status`'s hand-over to kube-scheduler)."""
    for i, entry in enumerate(ObjectView(obj).finalizers):
        if entry == finalizer:
            path = f"/metadata/finalizers/{i}"
            test = {"op": "test", "path": path, "value": finalizer}
            return [test, {"op": "remove", "path": path}]
    return None
