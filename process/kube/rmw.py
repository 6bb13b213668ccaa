"""Read-modify-write of one API object that other writers change too, in two forms.

Both binaries change objects that others change as well (kube-scheduler, the
kube-controller-manager, a second controller that still believes it leads, the controller and
the node agents on the same claim's finalizers). Every such write derives its change from a
copy of the object and must not undo what someone wrote since that copy was taken:

- `read_modify_write` sends a JSON merge patch of only the fields carve owns, carrying the
  `resourceVersion` it was derived from, so the apiserver refuses it (409) if anyone wrote in
  between. For fields whose value carve decides as a whole (a claim's `status.allocation`, a
  pod's scheduling gates and affinity together, a ResourceSlice's devices).
- `edit_pinned` sends a JSON patch whose `test` operations pin what it depends on instead: the
  object's uid (not a namesake created since) and whatever entries the operations touch. For
  one entry of a list that others write too (`process.kube.finalizers`, carve's scheduling
  gate): an unrelated write to the object never makes it conflict, and a failed test (422)
  means what it depends on changed.

Both run the same loop:

1. derive the change from the current copy (`mutate`: None means nothing to write, a
   `WriteSkippedError` means the write no longer makes sense);
2. send it, guarded as above;
3. when the guard refuses it (409, or 422 for a pinned patch) read the object again and derive
   the change again from the fresh copy; transient errors (429, 5xx, connection trouble) are
   retried too, with jittered exponential backoff and a bounded number of attempts, after which
   the last error is raised as it was;
4. before every attempt ask the `fence`: a controller that lost its lease must stop writing at
   once, even half-way through a retry loop.

Never the whole object: the apiserver compares a claim's opaque config as the bytes it
received, and a claim read and written back re-serialises them (see `controller.status`).

Errors say what happened: `ObjectGoneError` (deleted), `ObjectReplacedError` (deleted and created
again under the same name: a new UID is another object, never "ours"), `WriteSkippedError` (the
fresh copy says the write no longer applies) and its `WriteFencedError`.

This sits with the process plumbing rather than in `driver/`: it is apiserver I/O policy
(status codes, backoff, leadership fencing) that both binaries need around their domain logic,
and `driver/` stays the I/O-free shared core (NVML aside).
"""

from __future__ import annotations

import copy
import http.client
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3.exceptions
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from process.kube import Obj
from process.kube.errors import status_of

Fence = Callable[[], bool]

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

_log = logging.getLogger(__name__)


class ObjectGoneError(Exception):
    """The object was deleted (or replaced by one with another UID) while we worked on it."""


class ObjectReplacedError(ObjectGoneError):
    """An object of the same name but another UID stands where ours was."""


class WriteSkippedError(Exception):
    """The fresh object shows that this write no longer applies; the message says why."""


class WriteFencedError(WriteSkippedError):
    """The fence closed: this process may not write any more (a controller lost its lease)."""


_LINK_ERRORS = (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError)
"""What a broken or stalled connection raises. The Kubernetes client raises urllib3's own
errors (`ProtocolError` for a reset, `ReadTimeoutError`, `MaxRetryError`), which subclass
neither `ConnectionError` nor `TimeoutError`; `http.client` and the socket layer raise theirs
(`RemoteDisconnected`, `ssl.SSLError`, both `OSError`)."""


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: a conflict, throttling, a server-side failure, a dropped or
    stalled link. A link error after the request was sent is ambiguous (the apiserver may have
    applied it); another attempt is still safe, because it carries the guard it was derived
    under: if the first one landed, the second's resourceVersion is stale (409) or its `test`
    fails (422), and it is derived again from a fresh read, which shows the change made."""
    if status_of(exc) in (408, 409, 429, 500, 502, 503, 504):
        return True
    # urllib3's URL errors are ValueErrors too: a caller's mistake, never worth a retry.
    return isinstance(exc, _LINK_ERRORS) and not isinstance(exc, ValueError)


@dataclass(frozen=True)
class Target:
    """The one object to change: how to read it and how to send a change to it.

    `read()` returns the object as the apiserver has it now; `write(body)` sends `body` (already
    guarded: a merge patch carrying the resourceVersion, or a JSON patch's operations) and
    returns the object as written. Both raise the client's error with `.status` 404 when the
    object is gone.
    """

    namespace: str
    name: str
    uid: str
    read: Callable[[], Obj]
    write: Callable[[Any], Obj]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded attempts with full-jitter exponential backoff; the defaults keep a conflict storm
    to a few seconds, well inside a kubelet prepare deadline or a reconcile step."""

    attempts: int = 8
    initial_s: float = 0.05
    max_wait_s: float = 2.0


def _never_fenced() -> bool:
    return True


class _Attempt:
    """The state one `read_modify_write` or `edit_pinned` call carries across its attempts."""

    def __init__(
        self,
        target: Target,
        mutate: Callable[[Obj], Any],
        current: Obj | None,
        *,
        pinned: bool,
    ) -> None:
        self.target = target
        self.mutate = mutate
        self.current: Obj = current if current is not None else {}
        self.fresh = False  # has `current` been read by us (rather than handed in)?
        self.unread = current is None
        self.pinned = pinned
        self.refused = 422 if pinned else 409  # what the guard answers when it does not hold

    def reread(self) -> None:
        try:
            obj = self.target.read()
        except Exception as exc:
            if status_of(exc) == 404:
                raise ObjectGoneError(f"{self.target.key} was deleted") from exc
            raise
        if obj.get("metadata", {}).get("uid") != self.target.uid:
            raise ObjectReplacedError(f"object was replaced (uid {self.target.uid} is gone)")
        self.current = obj
        self.fresh = True
        self.unread = False

    def derive(self) -> Any:
        try:
            return self.mutate(copy.deepcopy(self.current))
        except WriteSkippedError:
            # A copy handed in may be a stale cache entry: judge again on a fresh read.
            if self.fresh:
                raise
            self.reread()
            return self.mutate(copy.deepcopy(self.current))

    def guarded(self, body: Any) -> Any:
        if self.pinned:
            return [{"op": "test", "path": "/metadata/uid", "value": self.target.uid}, *body]
        body.setdefault("metadata", {})["resourceVersion"] = self.current["metadata"].get(
            "resourceVersion"
        )
        return body

    def once(self, fence: Fence) -> Obj:
        if not fence():
            raise WriteFencedError("not the leader any more")
        if self.unread:
            self.reread()
        body = self.derive()
        if body is None:
            return self.current
        try:
            return self.target.write(self.guarded(body))
        except Exception as exc:
            if status_of(exc) == 404:
                raise ObjectGoneError(f"{self.target.key} was deleted") from exc
            if status_of(exc) == self.refused:
                self.reread()
                _log.info(
                    "%s writing %s; retrying on resourceVersion %s",
                    "failed test" if self.pinned else "conflict",
                    self.target.key,
                    self.current["metadata"].get("resourceVersion"),
                )
            raise

    def run(self, fence: Fence, policy: RetryPolicy, sleep: Callable[[float], None]) -> Obj:
        retrying = Retrying(
            retry=retry_if_exception(lambda e: is_transient(e) or status_of(e) == self.refused),
            stop=stop_after_attempt(policy.attempts),
            wait=wait_random_exponential(multiplier=policy.initial_s, max=policy.max_wait_s),
            sleep=sleep,
            reraise=True,
        )
        result: Obj = retrying(self.once, fence)
        return result


def read_modify_write(
    target: Target,
    mutate: Callable[[Obj], Obj | None],
    *,
    current: Obj | None = None,
    fence: Fence = _never_fenced,
    policy: RetryPolicy = RetryPolicy(),  # frozen, so one shared default is safe
    sleep: Callable[[float], None] = time.sleep,
) -> Obj:
    """Write the merge patch `mutate` derives from the object, guarded by its resourceVersion;
    see the module docstring. `current` is a copy to derive from first (an informer's cache
    entry); without one the object is read first. Returns the object as written, or the
    current copy when `mutate` found nothing to write."""
    state = _Attempt(target, mutate, current, pinned=False)
    return state.run(fence, policy, sleep)


def edit_pinned(
    target: Target,
    ops: Callable[[Obj], list[Obj] | None],
    *,
    current: Obj | None = None,
    fence: Fence = _never_fenced,
    policy: RetryPolicy = RetryPolicy(),
    sleep: Callable[[float], None] = time.sleep,
) -> Obj:
    """Write the JSON patch operations `ops` derives from the object, after a `test` of its
    uid; a failed test (422) reads it again and derives again (see the module docstring).
    `target.write` sends a JSON patch; `current` and the result are as for
    `read_modify_write`."""
    state = _Attempt(target, ops, current, pinned=True)
    return state.run(fence, policy, sleep)
