"""Commit: write a placement (allocation, gate, event), the binding cycle's second half.

A placement needs its writes in order (each claim's allocation, then the gate, then the event;
the finalizer first where admission did not add it); written inline they are apiserver
round trips in front of the next decision. With a pool beside the decision thread
(`commit_beside`), the decision thread *assumes* the plan instead, as kube-scheduler assumes
a pod in its cache before it binds: the store and the model hold each claim as the writes will
leave it, so no later decision hands its placement out again whatever the watch latency, and
the thread goes on to the next pod while the writes run. When they end (`CommitDone` on the
queue) the informer's copies are put back and the writes' answers applied. A failed commit may
have landed in part (a write whose answer was lost): its claims stay assumed until a fresh read
settles what the apiserver has (`controller.settle`), and the pod is placed again.

Invariant 1 holds either way: the model counts a placement from the moment it is decided.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from controller.config import ReconcilerConfig
from controller.memory import PodMemory, Wait
from controller.messages import CommitDone, Message, Settled
from controller.nodehealth.carvewait import plan_waits_for_carve
from controller.nodehealth.lost import LostNodes
from controller.objects import (
    ClaimAllocation,
    Kind,
    Plan,
    has_gate,
    is_allocated,
    is_older,
    key_of,
)
from controller.outcomes import Outcomes
from controller.release import Releaser, WritesBeside
from controller.seams import ClaimWriter, Metrics, Planner
from controller.settle import Settler
from controller.status import build_allocation_status
from controller.store import ClusterStore
from driver.apiviews import ClaimView
from process.kube import Obj

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Commit:
    """A placement whose writes are in flight beside the decision thread."""

    plan: Plan
    claims: tuple[Obj, ...]
    assumed: Mapping[str, Obj]  # claim key -> the assumed copy put in the store
    first_seen: float
    writing: tuple[ClaimAllocation, ...]  # the plan's allocations not yet written before


class Committer:
    """Writes plans, inline or beside the decision thread, and keeps the commits in flight."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        memory: PodMemory,
        planner: Planner,
        writer: ClaimWriter,
        outcomes: Outcomes,
        releaser: Releaser,
        lost: LostNodes,
        metrics: Metrics,
        config: ReconcilerConfig,
        written: Callable[[Obj], None],
        post: Callable[[Message], None],
        wall_clock: Callable[[], dt.datetime],
        clock: Callable[[], float],
        beside: WritesBeside | None,
    ) -> None:
        """`written(claim)` stores a claim written on this thread; `post(message)` queues one
        for the decision thread from the thread that writes beside it (`beside`; None: every
        commit is written inline, as the tests step it)."""
        self._store = store
        self._memory = memory
        self._planner = planner
        self._writer = writer
        self._outcomes = outcomes
        self._releaser = releaser
        self._lost = lost
        self._metrics = metrics
        self._cfg = config
        self._written = written
        self._post = post
        self._wall = wall_clock
        self._beside = beside
        self._committing: dict[str, _Commit] = {}  # pod key -> its commit in flight
        self._settler = Settler(
            store=store,
            memory=memory,
            read=writer.read_claim,
            post=post,
            beside=beside,
            clock=clock,
            settled=releaser.mark,
        )

    def in_flight(self, pod_key: str) -> bool:
        """Whether the pod's writes are in flight (its commit's end decides what is next)."""
        return pod_key in self._committing

    @property
    def any_in_flight(self) -> bool:
        return bool(self._committing)

    def commit(self, pod: Obj, wait: Wait, claims: Sequence[Obj], plan: Plan) -> None:
        """Write the plan claim by claim (beside this thread when it can take them); undo what
        was written if a later claim fails."""
        by_key = {key_of(c): c for c in claims}
        todo: list[tuple[ClaimAllocation, Obj]] = []
        for alloc in plan.allocations:
            ckey = f"{alloc.namespace}/{alloc.name}"
            claim = self._store.claims.get(ckey) or by_key[ckey]
            if not is_allocated(claim):
                todo.append((alloc, claim))
        hold = self._cfg.hold_gate_until_carved and any(
            plan_waits_for_carve(a.results) for a in plan.allocations
        )
        ungate = has_gate(pod, self._cfg.gate) and not hold
        if hold:
            # Placed: the gate stays while the node carves, carve's autoscaler hint does not.
            self._outcomes.hint(pod, None)
        if self._commit_beside(pod, wait, claims, plan, todo=todo, ungate=ungate):
            return
        classes = self._store.objects[Kind.CLASS]
        stored, error = _write_claims(self._writer, todo, classes)
        for claim in stored:
            self._written(claim)
        if error is not None:
            self._hold_until_read(key_of(pod), todo, classes)
            self._metrics.count_outcome("write-failed")
            raise error
        self._planner.committed(pod, plan)
        if ungate:
            self._store.put_pod(key_of(pod), self._writer.remove_gate(pod, protect=True))
        self._outcomes.placed(pod, wait.first_seen, plan, [a for a, _ in todo])

    def _commit_beside(
        self,
        pod: Obj,
        wait: Wait,
        claims: Sequence[Obj],
        plan: Plan,
        *,
        todo: Sequence[tuple[ClaimAllocation, Obj]],
        ungate: bool,
    ) -> bool:
        """Assume the plan in the store and model and hand its writes to `beside`; False
        (nothing assumed) when there is none or it took nothing."""
        if self._beside is None or not todo:
            return False
        key = key_of(pod)
        classes = dict(self._store.objects[Kind.CLASS])  # the writes must not see later changes
        writer, post = self._writer, self._post

        def writes() -> None:
            stored, error = _write_claims(writer, todo, classes)
            ungated: Obj | None = None
            allocated = error is None
            if allocated and ungate:
                try:
                    ungated = writer.remove_gate(pod, protect=True)
                except Exception as exc:
                    error = exc
            post(CommitDone(key, stored, ungated, error, allocated))

        now = self._wall()
        assumed = {
            key_of(claim): _assumed_copy(claim, alloc, classes, self._cfg.finalizer, now)
            for alloc, claim in todo
        }
        for ckey, copy_ in assumed.items():
            self._store.assume(ckey, copy_)
        self._planner.committed(pod, plan)
        self._committing[key] = _Commit(
            plan, tuple(claims), assumed, wait.first_seen, tuple(a for a, _ in todo)
        )
        if self._beside(key, writes):
            return True
        del self._committing[key]
        self._unassume(assumed)
        self._planner.withdrawn(pod)
        return False

    def _hold_until_read(
        self, pod_key: str, todo: Sequence[tuple[ClaimAllocation, Obj]], classes: Mapping[str, Obj]
    ) -> None:
        """A commit written on this thread failed: hold each claim as if written until a
        fresh read says what landed (`controller.settle`)."""
        now = self._wall()
        for alloc, claim in todo:
            ckey = key_of(claim)
            if self._store.is_assumed(ckey) or is_allocated(self._store.claims.get(ckey) or {}):
                continue  # held already, or its allocation is known to have landed
            copy_ = _assumed_copy(claim, alloc, classes, self._cfg.finalizer, now)
            self._store.assume(ckey, copy_)
            self._settler.hold(claim, copy_, pod_key)

    def settle_pass(self) -> None:
        """Read again the claims of failed commits that are due a read."""
        self._settler.read_pass()

    def settled(self, message: Settled, apply_read: Callable[[Obj], None]) -> None:
        """A fresh read of a held claim answered (`controller.settle`)."""
        self._settler.done(message, apply_read)

    def _unassume(self, assumed: Mapping[str, Obj]) -> None:
        for ckey, copy_ in assumed.items():
            self._store.unassume(ckey, copy_)
            self._releaser.mark(ckey)  # skipped while assumed; look again

    def done(self, result: CommitDone, apply_written: Callable[[Obj], None]) -> None:
        """A commit's writes ended: put the informer's copies back, apply what the writes
        answered (`apply_written`, as the queue's `WrittenBeside`), and tell how it went."""
        commit = self._committing.pop(result.pod, None)
        if commit is None:
            return
        self._memory.queue.changed(result.pod)  # the pod is visited again, whatever came of it
        # A failure before every allocation was written leaves claims whose last write may have
        # landed unanswered: they stay assumed until a fresh read settles them.
        unsure = {} if result.allocated else commit.assumed
        self._unassume({k: v for k, v in commit.assumed.items() if k not in unsure})
        for claim in result.stored:
            apply_written(claim)
        by_key = {key_of(c): c for c in commit.claims}
        for ckey, copy_ in unsure.items():
            self._settler.hold(by_key[ckey], copy_, result.pod)
        pod = self._store.pods.get(result.pod)
        if pod is None:
            return  # deleted meanwhile: its claims are released as for any pod that went
        if result.ungated is not None and not is_older(result.ungated, pod):
            self._store.put_pod(result.pod, result.ungated)
            pod = result.ungated
        if result.allocated:
            for claim in result.stored:
                self._lost.reallocated(key_of(claim))
        else:
            self._planner.withdrawn(pod)
        if result.error is not None:
            if not result.allocated:
                self._metrics.count_outcome("write-failed")
            wait = self._memory.waiting(result.pod, commit.first_seen)
            self._outcomes.failed(pod, wait, commit.claims, result.error)
            return
        self._outcomes.placed(pod, commit.first_seen, commit.plan, commit.writing)


def _write_claims(
    writer: ClaimWriter,
    todo: Sequence[tuple[ClaimAllocation, Obj]],
    classes: Mapping[str, Obj],
) -> tuple[tuple[Obj, ...], Exception | None]:
    """A plan's claim writes: finalizer, then allocation, claim by claim; on a failure the
    allocations already written are cleared again. Returns the last copy of every claim
    written, as the apiserver answered, and the failure (None: all written)."""
    stored: dict[str, Obj] = {}
    written: list[Obj] = []
    try:
        for alloc, unwritten in todo:
            claim = writer.add_finalizer(unwritten)
            stored[key_of(claim)] = claim
            claim = writer.write_allocation(claim, alloc, classes)
            stored[key_of(claim)] = claim
            written.append(claim)
    except Exception as exc:
        for claim in written:
            try:
                stored[key_of(claim)] = writer.clear_allocation(claim)
            except Exception:
                _log.exception("rollback of claim %s failed", key_of(claim))
        return tuple(stored.values()), exc
    return tuple(stored.values()), None


def _assumed_copy(
    claim: Obj,
    alloc: ClaimAllocation,
    classes: Mapping[str, Obj],
    finalizer: str,
    now: dt.datetime,
) -> Obj:
    """The claim as the commit's writes will leave it: our finalizer and the allocation."""
    view = ClaimView(claim)
    finalizers = list(view.finalizers)
    if finalizer not in finalizers:
        finalizers.append(finalizer)
    status = {**view.status, "allocation": build_allocation_status(claim, alloc, classes, now)}
    return {**claim, "metadata": {**view.metadata, "finalizers": finalizers}, "status": status}
