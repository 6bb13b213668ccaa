"""Claims a gated pod names that the store does not hold: not created yet, or not carve's.

The controller keeps only carve's claims (`controller.cache.claim_view`), so another driver's
claim never reaches the store, and a pod that uses a carve claim and, say, a NIC's claim would
wait for the NIC's claim forever. For the few claims a gated pod names and the store lacks, a
fresh read tells the two apart: a claim that exists and is not carve's is marked foreign in the
store (the pod stops waiting for it; kube-scheduler handles it); a carve claim is left to the
informer, which delivers it (applying a read here could bring back a claim deleted meanwhile);
a claim that does not exist yet is read again after a growing wait, for as long as a live pod
names it. One read per such claim, not a cache of every foreign claim in the cluster.

Reads run beside the decision thread when a pool takes them, else on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controller.messages import LookedUp, Message
from controller.objects import CarveClasses, is_carve_claim
from controller.store import ClusterStore
from driver.apiviews import ObjectView
from process.kube import Obj
from process.kube.errors import status_of

_log = logging.getLogger(__name__)

_FIRST_RETRY_S = 1.0
_MAX_RETRY_S = 30.0


@dataclass
class _Wanted:
    failures: int = 0
    next_read: float = 0.0
    reading: bool = False


class ClaimLookup:
    """Reads the claims gated pods name that the store lacks, and marks the foreign ones."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        classes: CarveClasses,
        read: Callable[[Obj], Obj],
        post: Callable[[Message], None],
        beside: Callable[[str, Callable[[], None]], bool] | None,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._classes = classes
        self._read = read
        self._post = post
        self._beside = beside
        self._clock = clock
        self._wanted: dict[str, _Wanted] = {}

    def want(self, claim_keys: Iterable[str]) -> None:
        """Find out about these claims (keys of claims a gated pod names, not in the store)."""
        for key in claim_keys:
            self._wanted.setdefault(key, _Wanted())

    def read_pass(self) -> None:
        """Start the reads that are due (on the decision thread, once per step)."""
        if not self._wanted:
            return
        now = self._clock()
        for key, wanted in list(self._wanted.items()):
            if key in self._store.claims or key in self._store.foreign:
                del self._wanted[key]  # the informer delivered it, or it is known foreign
                continue
            if not self._store.users_of(key):
                del self._wanted[key]  # no live pod names it any more
                continue
            if wanted.reading or wanted.next_read > now:
                continue
            wanted.reading = True
            job = self._job(key)
            if self._beside is None or not self._beside(f"lookup/{key}", job):
                job()

    def _job(self, key: str) -> Callable[[], None]:
        read, post = self._read, self._post
        namespace, _, name = key.partition("/")

        def job() -> None:
            try:
                found = read({"metadata": {"namespace": namespace, "name": name}})
            except Exception as exc:
                if status_of(exc) == 404:
                    post(LookedUp(key, None))
                else:
                    post(LookedUp(key, None, error=str(exc) or type(exc).__name__))
                return
            post(LookedUp(key, found))

        return job

    def done(self, message: LookedUp) -> None:
        """A read answered (on the decision thread)."""
        wanted = self._wanted.get(message.claim)
        if wanted is None:
            return
        wanted.reading = False
        found = message.found
        if found is not None and not is_carve_claim(found, self._classes):
            del self._wanted[message.claim]
            uid = ObjectView(found).uid
            self._store.mark_foreign(message.claim, uid)
            _log.debug("claim %s is not carve's", message.claim, extra={"claim": message.claim})
            return
        # Not there yet (or carve's, and the watch has yet to deliver it): look again later.
        wanted.failures += 1
        wanted.next_read = self._clock() + min(
            _MAX_RETRY_S, _FIRST_RETRY_S * 2 ** (wanted.failures - 1)
        )
        if message.error is not None:
            _log.info("reading claim %s failed: %s", message.claim, message.error)
