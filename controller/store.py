"""The cluster as the decision thread knows it, kept in step with the planner's model.

This is the role kube-scheduler's cache plays for its scheduling cycle: one dict per kind of
what the informers delivered (or this controller just wrote), an index from each claim to the
live pods that use it (so a release decision does not scan every pod), and the claims
*assumed* for placements whose writes are still in flight beside the decision thread. Every
change here is fed to the planner (`Planner.observe` / `forget`) before the next decision, so
the model never lags the store, and the pods a change concerns are marked for classification
again (`controller.memory`).

Owned by the decision thread; nothing here is thread-safe.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from controller.memory import PodMemory
from controller.objects import (
    EventType,
    Kind,
    is_allocated,
    is_older,
    key_of,
    pod_claim_names,
)
from controller.seams import Planner
from driver.apiviews import ClaimView, ObjectView, PodView
from process.kube import Obj


class ClusterStore:
    """The decision thread's copy of the cluster (the module docstring says what it keeps)."""

    def __init__(self, planner: Planner, memory: PodMemory) -> None:
        self._planner = planner
        self._memory = memory
        self.objects: dict[Kind, dict[str, Obj]] = {k: {} for k in Kind}
        self._users: dict[str, set[str]] = {}  # claim key -> keys of live pods using it
        self._uses: dict[str, set[str]] = {}  # pod key -> claim keys it uses
        # Claim key -> the newest copy the informer gave of a claim held assumed meanwhile.
        self._assumed: dict[str, Obj] = {}
        # Claim key -> UID of a claim a live pod names that exists but is not carve's (the
        # informer keeps only carve's claims; `controller.lookup` finds these out).
        self._foreign: dict[str, str] = {}
        # Claim key -> UID of a claim seen allocated since this process started: an ungated
        # pod whose such claim is unallocated again had it cleared (kube-scheduler's
        # PostFilter); one whose claims never were allocated escaped carve's gate. (The
        # allocation finalizer cannot tell them apart: carve's admission policy adds it at
        # creation.)
        self._seen_allocated: dict[str, str] = {}
        # Keys of allocated claims no live pod uses any more: their placement is being freed
        # (the node tears the instance down, the allocation or the claim goes). Kept by
        # `controller.release.Releaser`; a refused pod that would fit once they are free waits
        # for a release in flight (`controller.autoscaling`).
        self.releasing: set[str] = set()

    @property
    def claims(self) -> Mapping[str, Obj]:
        return self.objects[Kind.CLAIM]

    @property
    def pods(self) -> Mapping[str, Obj]:
        return self.objects[Kind.POD]

    @property
    def foreign(self) -> Collection[str]:
        """Keys of claims named by live pods that exist and are not carve's."""
        return self._foreign.keys()

    def mark_foreign(self, claim_key: str, uid: str) -> None:
        """A claim a live pod names exists and is not carve's: its pods need not wait for it."""
        if self.users_of(claim_key):
            self._foreign[claim_key] = uid
            self._memory.wake_users(self.users_of(claim_key))

    # -- informer events -----------------------------------------------------------------------

    def apply(self, kind: Kind, type_: EventType, obj: Obj) -> bool:
        """Apply an informer event (or a write's answer delivered as one); False when it changed
        nothing: a late copy of an object stored newer, or a claim held assumed."""
        key = key_of(obj)
        if kind is Kind.CLAIM:
            self._foreign.pop(key, None)  # the informer delivers carve's claims only
            self._note_allocated(key, None if type_ is EventType.DELETED else obj)
        if kind is Kind.CLAIM and key in self._assumed and self._keeps_assumption(type_, obj):
            return False
        store = self.objects[kind]
        if type_ is EventType.DELETED:
            old = store.pop(key, None)
            self._planner.forget(kind, old or obj)
        else:
            old = store.get(key)
            if is_older(obj, old):
                return False
            store[key] = obj
            self._planner.observe(kind, obj)
        gone = type_ is EventType.DELETED
        if kind is Kind.POD:
            self._memory.queue.changed(key)
            self._index_pod(key, None if gone else obj)
            self._memory.index(key, None if gone else obj)
        elif kind is Kind.CLAIM:
            self._memory.wake_users(self.users_of(key))
            if gone or _allocation_dropped(old, obj):
                self._memory.wake_all(capacity=True)
        else:
            self._memory.wake_all(capacity=kind is not Kind.CLASS, classes=kind is Kind.CLASS)
        return True

    def _index_pod(self, key: str, pod: Obj | None) -> None:
        """Keep claim -> live pods current, so release decisions do not scan every pod."""
        old = self._uses.pop(key, set())
        for claim_key in old:
            users = self._users.get(claim_key)
            if users is not None:
                users.discard(key)
                if not users:
                    del self._users[claim_key]
        claim_keys: set[str] = set()
        if pod is not None and not PodView(pod).terminal:
            ns = ObjectView(pod).namespace
            claim_keys = {f"{ns}/{name}" for name in pod_claim_names(pod)[0]}
        if claim_keys:
            self._uses[key] = claim_keys
            for claim_key in claim_keys:
                self._users.setdefault(claim_key, set()).add(key)
        for claim_key in old - claim_keys:
            if claim_key not in self._users:
                self._foreign.pop(claim_key, None)  # no live pod names it any more

    def was_allocated(self, claim: Obj) -> bool:
        """Whether this claim (same UID) was seen allocated since this process started."""
        return self._seen_allocated.get(key_of(claim)) == ObjectView(claim).uid

    def _note_allocated(self, key: str, claim: Obj | None) -> None:
        if claim is None:
            self._seen_allocated.pop(key, None)
        elif ClaimView(claim).allocated:
            self._seen_allocated[key] = ObjectView(claim).uid

    def users_of(self, claim_key: str) -> Collection[str]:
        """Keys of the live (not terminated) pods that name the claim."""
        return self._users.get(claim_key, ())

    # -- this controller's writes --------------------------------------------------------------

    def put_pod(self, key: str, pod: Obj) -> None:
        """Store a pod this controller just wrote."""
        self.objects[Kind.POD][key] = pod
        self._memory.queue.changed(key)
        self._memory.index(key, pod)

    def put_claim(self, claim: Obj) -> bool:
        """Feed a claim this controller just wrote into the store and model before any further
        decision; False if the store already holds a newer copy."""
        key = key_of(claim)
        old = self.objects[Kind.CLAIM].get(key)
        if is_older(claim, old):
            return False
        self.objects[Kind.CLAIM][key] = claim
        self._note_allocated(key, claim)
        self._planner.observe(Kind.CLAIM, claim)
        self._memory.claim_changed(self.users_of(key))
        if _allocation_dropped(old, claim):
            self._memory.wake_all(capacity=True)
        return True

    def still_stored(self, written: Obj) -> bool:
        """Whether a claim written beside the decision thread may go into the store.

        Its copy reaches the queue only once the write's response is back, and the informer's
        later events about the claim can be applied first, its deletion included: dropping the
        last finalizer of a deleted claim deletes it, and the apiserver answers with the claim
        as it was, allocated. Stored after the deletion, that copy would hold its placement in
        the model for good. So only a claim still stored, as the same object, takes it (and
        `is_older` keeps a newer informer copy over it)."""
        old = self.objects[Kind.CLAIM].get(key_of(written))
        return old is not None and ObjectView(old).uid == ObjectView(written).uid

    # -- assumed claims (commits in flight) ----------------------------------------------------

    def assume(self, claim_key: str, assumed: Obj) -> None:
        """Hold `assumed` (the claim as a commit's writes will leave it) in the store and model
        until `unassume`; the informer's copies are kept aside meanwhile."""
        self._assumed[claim_key] = self.objects[Kind.CLAIM].get(claim_key) or assumed
        self.objects[Kind.CLAIM][claim_key] = assumed
        self._planner.observe(Kind.CLAIM, assumed)
        self._memory.claim_changed(self.users_of(claim_key))

    def unassume(self, claim_key: str, assumed: Obj) -> None:
        """Put back the informer's copy of a claim still held as `assumed`."""
        store = self.objects[Kind.CLAIM]
        real = self._assumed.pop(claim_key, None)
        if store.get(claim_key) is assumed and real is not None:
            store[claim_key] = real
            self._planner.observe(Kind.CLAIM, real)
            self._memory.claim_changed(self.users_of(claim_key))
            self._memory.wake_all(capacity=True)

    def is_assumed(self, claim_key: str) -> bool:
        return claim_key in self._assumed

    def any_assumed(self, claims: Collection[Obj]) -> bool:
        """Whether any of `claims` is held assumed (cheap when nothing is)."""
        return bool(self._assumed) and any(key_of(c) in self._assumed for c in claims)

    def _keeps_assumption(self, type_: EventType, claim: Obj) -> bool:
        """An informer copy of a claim held assumed: while it shows our allocation not yet
        written (the finalizer alone, or nothing new), the assumed copy stays in the store and
        the informer's is kept aside for the commit's end. A deletion or an allocation
        (written by us, or by anyone) ends the assumption: the informer's copy is the truth."""
        key = key_of(claim)
        if type_ is EventType.DELETED or is_allocated(claim):
            self._assumed.pop(key, None)
            return False
        if not is_older(claim, self._assumed[key]):
            self._assumed[key] = claim
        return True


def _allocation_dropped(old: Obj | None, new: Obj) -> bool:
    return old is not None and is_allocated(old) and not is_allocated(new)
