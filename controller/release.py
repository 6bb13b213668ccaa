"""Release (invariant 4): a placement is busy from allocation until the node confirms that its
MIG instance is gone.

An allocation is cleared only when the claim is reserved for nobody, no live pod uses it, and no
node finalizer (`Contract.node_finalizer`, the kubelet plugin's) remains, which means the node
has destroyed the instance. The controller's finalizer goes only with the claim: a claim being
deleted loses it (one write, the allocation goes with the object), one that stays keeps it for
its next placement (carve's admission policy put it there at creation). A claim made from a
pod's template is not cleared at all: kube-controller-manager deletes it once its pod is done,
so its release is the one finalizer write. `release_action` is that
rule as a pure decision over one claim; `Releaser` applies it to the claims that changed since the
last pass, writing on a pool beside the decision thread when it has one (`release_beside`):
inline, every pod that ended put two apiserver round trips in front of the next placement.

Claims allocated to a lost node follow their own rules (`controller.nodehealth.lost`).
"""

from __future__ import annotations

import datetime as dt
import enum
import logging
from collections.abc import Callable, Iterable

from controller.config import ReconcilerConfig
from controller.messages import Message, ReleaseDone, WrittenBeside
from controller.nodehealth.lost import LostNodes
from controller.objects import has_finalizer, key_of, node_finalizers
from controller.seams import ClaimWriter
from controller.status import ObjectGoneError, WriteSkippedError
from controller.store import ClusterStore
from driver.apiviews import ClaimView
from driver.contract import DEFAULT_CONTRACT, Contract
from process.kube import Obj

_log = logging.getLogger(__name__)

WritesBeside = Callable[[str, Callable[[], None]], bool]
"""`(key, writes) -> taken`: runs `writes` on another thread, in order per key, or answers
False when it cannot take them now (`controller.writepool.WritePool.offer`)."""


class ReleaseKind(enum.Enum):
    KEEP = "keep"
    WAIT_NODE = "wait-node"
    CLEAR = "clear"
    DROP_FINALIZER = "drop-finalizer"


def release_action(
    claim: Obj,
    live_consumers: int,
    contract: Contract = DEFAULT_CONTRACT,
) -> ReleaseKind:
    """Invariant 4 as a pure decision over one claim.

    `live_consumers` counts pods in the claim's namespace that use it and have not terminated:
    a claim allocated for a still-gated pod has an empty `reservedFor` too, and must stay.
    """
    if not has_finalizer(claim, contract.allocation_finalizer):
        return ReleaseKind.KEEP
    view = ClaimView(claim)
    deleting = view.deleting
    if view.reserved_for:
        return ReleaseKind.KEEP
    if not deleting and live_consumers > 0:
        return ReleaseKind.KEEP
    if node_finalizers(claim, contract):
        return ReleaseKind.WAIT_NODE
    if view.allocated and not deleting:
        if generated_for_a_pod(claim):
            # kube-controller-manager deletes a claim made from a template once its pod is
            # done or gone, and no other pod can use it: clearing the allocation first would
            # be a second write (racing kube-controller-manager's own, a 409 and a GET), and
            # the devices come free with the deletion, one write later.
            return ReleaseKind.KEEP
        return ReleaseKind.CLEAR
    if not deleting:
        # Unallocated and still wanted: the finalizer came with the claim (carve's admission
        # policy) or stays from its last placement, ready for the next one.
        return ReleaseKind.KEEP
    return ReleaseKind.DROP_FINALIZER


def generated_for_a_pod(claim: Obj) -> bool:
    """Made from a pod's ResourceClaimTemplate (or kube-scheduler's for extended resources):
    the pod is its controlling owner, so it is never shared and goes when the pod is done."""
    return any(
        ref.get("kind") == "Pod" and ref.get("controller") is True
        for ref in ClaimView(claim).owner_references
    )


class Releaser:
    """Looks again at the claims marked since its last pass and releases what may go."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        lost: LostNodes,
        writer: ClaimWriter,
        config: ReconcilerConfig,
        written: Callable[[Obj], None],
        post: Callable[[Message], None],
        wall_clock: Callable[[], dt.datetime],
        beside: WritesBeside | None,
    ) -> None:
        """`written(claim)` stores a claim written on this thread; `post(message)` queues one
        for the decision thread from the thread that writes beside it (`beside`; None: every
        release is written inline, as the tests step it). The model learns of a write beside
        from the queue, as of an informer event, so until then the placement counts as busy:
        late, never early."""
        self._store = store
        self._lost = lost
        self._writer = writer
        self._contract = config.contract
        self._written = written
        self._post = post
        self._wall = wall_clock
        self._beside = beside
        self._dirty: set[str] = set()  # claims to look at in the next pass
        self._releasing: set[str] = set()  # claims whose release writes are in flight beside

    def mark(self, claim_key: str) -> None:
        """Look at the claim in the next pass."""
        self._dirty.add(claim_key)

    def mark_all(self, claim_keys: Iterable[str]) -> None:
        self._dirty.update(claim_keys)

    @property
    def in_flight(self) -> bool:
        """Whether release writes are in flight beside the decision thread."""
        return bool(self._releasing)

    def _note_pending(self, key: str, claim: Obj | None) -> None:
        """Keep `ClusterStore.releasing`: allocated claims no live pod uses any more."""
        if claim is not None and ClaimView(claim).allocated and not self._store.users_of(key):
            self._store.releasing.add(key)
        else:
            self._store.releasing.discard(key)

    def done(self, message: ReleaseDone) -> None:
        """Look again: a failed write is retried, a finished one may have a next step."""
        self._releasing.discard(message.claim)
        self._dirty.add(message.claim)

    def release_pass(self) -> None:
        dirty, self._dirty = self._dirty, set()
        now = self._wall()
        for key in sorted(dirty):
            claim = self._store.claims.get(key)
            self._note_pending(key, claim)
            if claim is None:
                self._lost.claim_gone(key)
                continue
            if key in self._releasing or self._store.is_assumed(key):
                continue  # its writes are in flight; their completion marks it dirty again
            loss = self._lost.loss_of(claim, now)
            try:
                if loss is not None:
                    self._lost.release(claim, loss)
                    continue
                action = release_action(claim, len(self._store.users_of(key)), self._contract)
                if action in (ReleaseKind.CLEAR, ReleaseKind.DROP_FINALIZER) and (
                    self._release_beside(claim, action)
                ):
                    continue
                self._release(claim, action, self._written)
            except (WriteSkippedError, ObjectGoneError) as exc:
                _log.info("release of claim %s skipped: %s", key, exc)
            except Exception:
                _log.exception("release of claim %s failed; will retry", key)
                self._dirty.add(key)

    def _release_beside(self, claim: Obj, action: ReleaseKind) -> bool:
        """Hand the claim's release writes to `beside`; False if it took nothing."""
        if self._beside is None:
            return False
        key = key_of(claim)

        def writes() -> None:
            try:
                self._release(claim, action, lambda fresh: self._post(WrittenBeside(fresh)))
            except (WriteSkippedError, ObjectGoneError) as exc:
                _log.info("release of claim %s skipped: %s", key, exc)
            except Exception:
                _log.exception("release of claim %s failed; will retry", key)
            finally:
                self._post(ReleaseDone(key))

        self._releasing.add(key)
        if self._beside(key, writes):
            return True
        self._releasing.discard(key)
        return False

    def _release(self, claim: Obj, action: ReleaseKind, store: Callable[[Obj], None]) -> None:
        """One write: clear the allocation of a claim that stays (the node confirmed the
        teardown; the finalizer stays for its next placement), or drop our finalizer from one
        being deleted (its allocation goes with it). No event: the claim's status says it,
        and a release is the commonest thing the controller does. `store` takes the claim as
        the apiserver answered."""
        key = key_of(claim)
        if action is ReleaseKind.CLEAR:
            store(self._writer.clear_allocation(claim))
            _log.info("released allocation of claim %s", key, extra={"claim": key})
        if action is ReleaseKind.DROP_FINALIZER:
            fresh = self._writer.remove_finalizer(claim)
            store(fresh)
            _log.info("removed controller finalizer from claim %s", key, extra={"claim": key})
