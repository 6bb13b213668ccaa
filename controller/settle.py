"""Placements whose writes may or may not have landed, held until a fresh read says which.

A write whose answer never came (a connection reset after the request was sent, a read
timeout, a retry budget spent on such errors) is ambiguous: the apiserver may have applied the
allocation. Putting the claim back as the informer last showed it would free a placement that
the apiserver may hold, and the next like pod could be given the same device before the watch
delivers the truth (invariant 1). So a commit that fails keeps every claim it was writing
*assumed* (held in the store and the model as the writes would have left it) and hands it
here; the claim is read again from the apiserver (a GET is a quorum read), and only that
answer, or an informer event that ends the assumption (the allocation seen, or the claim
deleted), puts the claim back as it really is. A read that fails is tried again with a growing
wait; meanwhile the placement stays held, late, never early.

Reads run beside the decision thread when a pool takes them (the commit workers), else on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from controller.memory import PodMemory
from controller.messages import Message, Settled
from controller.objects import key_of
from controller.store import ClusterStore
from driver.apiviews import ClaimView
from process.kube import Obj
from process.kube.errors import status_of

_log = logging.getLogger(__name__)

_FIRST_RETRY_S = 1.0
_MAX_RETRY_S = 30.0


@dataclass
class _Held:
    claim: Obj  # the copy to read (namespace, name, uid)
    assumed: Obj  # the assumed copy the store holds for it
    pod: str  # the pod whose commit failed: it keeps its backoff when the claim is freed
    failures: int = 0
    next_read: float = 0.0
    reading: bool = False


class Settler:
    """Claims held assumed after a failed commit, and the fresh reads that release them."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        memory: PodMemory,
        read: Callable[[Obj], Obj],
        post: Callable[[Message], None],
        beside: Callable[[str, Callable[[], None]], bool] | None,
        clock: Callable[[], float],
        settled: Callable[[str], None],
    ) -> None:
        """`read(claim)` is a fresh GET of the claim (an error with `.status` 404 when it is
        gone); `post` queues a message for the decision thread; `settled(key)` is told once
        the claim is as the apiserver has it again (the release pass looks at it then)."""
        self._store = store
        self._memory = memory
        self._read = read
        self._post = post
        self._beside = beside
        self._clock = clock
        self._settled = settled
        self._held: dict[str, _Held] = {}

    def hold(self, claim: Obj, assumed: Obj, pod: str) -> None:
        """Keep `assumed` (already in the store) until a fresh read of `claim` settles it;
        `pod` is the pod whose commit failed."""
        key = key_of(claim)
        self._held[key] = _Held(claim, assumed, pod)
        _log.warning(
            "claim %s: a write for it failed and may have landed; its placement stays held "
            "until a fresh read shows what the apiserver has",
            key,
            extra={"claim": key},
        )

    def holds(self, claim_key: str) -> bool:
        return claim_key in self._held

    def read_pass(self) -> None:
        """Start the reads that are due (call on the decision thread, once per step)."""
        if not self._held:
            return
        now = self._clock()
        for key, held in list(self._held.items()):
            if not self._store.is_assumed(key):
                # An informer event ended the assumption: the allocation was seen, or the
                # claim was deleted. The store holds the truth already.
                del self._held[key]
                self._settled(key)
                continue
            if held.reading or held.next_read > now:
                continue
            held.reading = True
            job = self._job(key, held.claim)
            if self._beside is None or not self._beside(key, job):
                job()

    def _job(self, key: str, claim: Obj) -> Callable[[], None]:
        read, post = self._read, self._post

        def job() -> None:
            try:
                fresh = read(claim)
            except Exception as exc:
                if status_of(exc) == 404:
                    post(Settled(key, None, gone=True))
                else:
                    post(Settled(key, None, error=str(exc) or type(exc).__name__))
                return
            post(Settled(key, fresh))

        return job

    def done(self, message: Settled, apply_read: Callable[[Obj], None]) -> None:
        """A read answered (on the decision thread): put the claim back as read, or try again
        later if the read failed."""
        held = self._held.get(message.claim)
        if held is None:
            return
        held.reading = False
        if message.error is not None:
            held.failures += 1
            wait = min(_MAX_RETRY_S, _FIRST_RETRY_S * 2 ** (held.failures - 1))
            held.next_read = self._clock() + wait
            _log.warning(
                "claim %s: reading it to settle a failed write failed (%s); its placement "
                "stays held, next read in %.0fs",
                message.claim,
                message.error,
                wait,
                extra={"claim": message.claim},
            )
            return
        del self._held[message.claim]
        # Freed capacity wakes every waiting pod, but the pod whose write failed keeps its
        # backoff: a refusal that a read cannot change (403, 422) must not become a hot loop.
        wait = self._memory.wait_of(held.pod)
        backoff = (wait.retry_at, wait.permanent) if wait is not None else None
        self._store.unassume(message.claim, held.assumed)
        if message.fresh is not None:
            apply_read(message.fresh)
        if wait is not None and backoff is not None:
            wait.retry_at, wait.permanent = backoff
        _log.info(
            "claim %s settled by a fresh read: %s",
            message.claim,
            "gone" if message.gone else "allocated" if _allocated(message.fresh) else "free",
            extra={"claim": message.claim},
        )
        self._settled(message.claim)


def _allocated(claim: Obj | None) -> bool:
    return claim is not None and ClaimView(claim).allocated
