"""The controller's state machine: gated pods in, allocated claims and ungated pods out.

One thread owns all decisions. Informer threads only put what they saw on a queue (typed
messages, `controller.messages`); `Reconciler.step` applies them to the store and the planner's
model, then frees what may be freed and places waiting pods one at a time, highest priority
first, then oldest. Because the model is fed each claim as written (or, while its writes are in
flight beside this thread, as assumed) before the next decision, two pods can never be given
the same placement, whatever the watch latency.

The reconciler composes its parts and runs the passes; each part owns one job:

- `controller.store.ClusterStore`: the objects, the claim -> pods index, the assumed claims;
- `controller.memory.PodMemory`: one record per pod that may need the controller, its queue;
- `controller.nodehealth.lost.LostNodes`: claims of lost nodes;
- `controller.release.Releaser`: invariant 4, a placement busy until the node confirms;
- `controller.placing.Placer` and `controller.commit.Committer`: a pod's placement decided,
  then written (the binding cycle); `controller.nodehealth.carvehold.CarveHold`: the gate kept
  while the node carves;
- `controller.outcomes.Outcomes`: what the user and the metrics are told.

The placement engine is reached through the narrow `Planner` seam (`controller.seams`), so
nothing here knows MIG geometry: it asks "where does this pod's set of claims go?" and gets a
`Plan` or an `Unplaceable` explanation to show to the user.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence

from controller.commit import Committer
from controller.config import ReconcilerConfig
from controller.conflicts import ConflictReporter
from controller.duplicategpus import DuplicateGpuReporter
from controller.extended_resources import asks_carve_resources, resource_classes
from controller.lookup import ClaimLookup
from controller.memory import PodMemory
from controller.messages import (
    CommitDone,
    LookedUp,
    Message,
    ReleaseDone,
    Settled,
    Synced,
    Watched,
    WrittenBeside,
)
from controller.nodehealth.carvehold import CarveHold
from controller.nodehealth.lost import LostNodes
from controller.objects import (
    EventType,
    Kind,
    Unplaceable,
    has_gate,
    is_allocated,
    key_of,
    pod_claim_names,
    priority_key,
)
from controller.outcomes import Defer, Outcomes
from controller.placing import Placer
from controller.podqueue import Queued
from controller.release import Releaser, WritesBeside
from controller.seams import ClaimWriter, Metrics, Planner, PreemptionHook, Recorder
from controller.store import ClusterStore
from controller.work import GATED_ELSEWHERE, PodWork, WorkKind, pod_work
from driver.apiviews import PodView
from process.kube import Obj

_log = logging.getLogger(__name__)


class Reconciler:
    """Owns the store, the planner's model and every write. Call `step` from one thread only."""

    def __init__(
        self,
        planner: Planner,
        writer: ClaimWriter,
        recorder: Recorder,
        *,
        config: ReconcilerConfig | None = None,
        metrics: Metrics | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        defer: Defer | None = None,
        preemption: PreemptionHook | None = None,
        release_beside: WritesBeside | None = None,
        commit_beside: WritesBeside | None = None,
    ) -> None:
        """`defer(key, write)` runs a best-effort write (a pod condition) later and in order per
        key (`controller.writepool`); by default it runs at once, on this thread.

        `release_beside(key, writes)` runs a released claim's writes (clear the allocation, drop
        the finalizer) on another thread, or returns False when it cannot take them (they then
        run here). Inline, every pod that ended put two apiserver round trips in front of the
        next pod's placement. The model learns of each write from the queue, as of an informer
        event, so until then the placement counts as busy: late, never early (invariant 4).
        None: inline, as the tests step it.

        `commit_beside(key, writes)` likewise runs a placement's writes (finalizer, allocation,
        gate) on another thread. The decision thread assumes the allocation in its store and
        model and goes on to the next pod, so placements of different pods write in parallel
        instead of three round trips each in a row; a failed commit puts the claims back as the
        apiserver has them and the pod is placed again."""
        self._cfg = cfg = config or ReconcilerConfig()
        self._metrics: Metrics = metrics or _NullMetrics()
        self._planner = planner
        self._is_leader = is_leader
        self._clock = clock
        self._wall = wall_clock
        self._messages: queue.Queue[Message] = queue.Queue()
        self._synced: set[Kind] = set()
        self._extended_names: dict[str, str] | None = None  # resource_classes(), per class change
        self._memory = PodMemory(cfg.gate)
        self._store = ClusterStore(planner, self._memory)
        self._compose_freeing(writer, recorder, release_beside)
        self._compose_placing(writer, recorder, defer or _run_now, preemption, commit_beside)

    def _compose_freeing(
        self, writer: ClaimWriter, recorder: Recorder, beside: WritesBeside | None
    ) -> None:
        """The parts that free placements: lost nodes' claims, then invariant 4's release."""
        store, cfg, wall_clock = self._store, self._cfg, self._wall
        written, post = self._claim_written, self._messages.put
        self._lost = lost = LostNodes(
            store=store,
            writer=writer,
            recorder=recorder,
            config=cfg,
            written=written,
            wall_clock=wall_clock,
        )
        self._releaser = Releaser(
            store=store,
            lost=lost,
            writer=writer,
            config=cfg,
            written=written,
            post=post,
            wall_clock=wall_clock,
            beside=beside,
        )

    def _compose_placing(
        self,
        writer: ClaimWriter,
        recorder: Recorder,
        defer: Defer,
        preemption: PreemptionHook | None,
        beside: WritesBeside | None,
    ) -> None:
        """The parts that place: the decision, its commit, the carve wait, what users are told."""
        store, memory, cfg, planner = self._store, self._memory, self._cfg, self._planner
        written, post, lost = self._claim_written, self._messages.put, self._lost
        self._outcomes = outcomes = Outcomes(
            store=store,
            memory=memory,
            writer=writer,
            recorder=recorder,
            metrics=self._metrics,
            config=cfg,
            written=written,
            defer=defer,
            clock=self._clock,
            wall_clock=self._wall,
        )
        self._committer = committer = Committer(
            store=store,
            memory=memory,
            planner=planner,
            writer=writer,
            outcomes=outcomes,
            releaser=self._releaser,
            lost=lost,
            metrics=self._metrics,
            config=cfg,
            written=written,
            post=post,
            wall_clock=self._wall,
            clock=self._clock,
            beside=beside,
        )
        self._lookup = ClaimLookup(
            store=store,
            classes=cfg.classes,
            read=writer.read_claim,
            post=post,
            beside=beside,
            clock=self._clock,
        )
        self._placer = Placer(
            store=store,
            memory=memory,
            planner=planner,
            committer=committer,
            outcomes=outcomes,
            lost=lost,
            writer=writer,
            recorder=recorder,
            metrics=self._metrics,
            config=cfg,
            preemption=preemption,
            clock=self._clock,
        )
        self._conflicts = ConflictReporter(
            store=store,
            recorder=recorder,
            metrics=self._metrics,
            clock=self._clock,
            interval=cfg.event_interval,
        )
        self._duplicates = DuplicateGpuReporter(
            recorder=recorder, metrics=self._metrics, clock=self._clock, interval=cfg.event_interval
        )
        self._carve_hold = CarveHold(
            memory=memory,
            writer=writer,
            recorder=recorder,
            outcomes=outcomes,
            config=cfg,
            written=written,
            wall_clock=self._wall,
        )

    # -- input (any thread) --------------------------------------------------------------------

    def enqueue(self, kind: Kind, type_: EventType, obj: Obj) -> None:
        self._messages.put(Watched(kind, type_, obj))

    def mark_synced(self, kind: Kind) -> None:
        self._messages.put(Synced(kind))

    @property
    def synced(self) -> bool:
        return self._synced >= set(Kind)

    @property
    def stores(self) -> Mapping[Kind, Mapping[str, Obj]]:
        """The objects as the decision thread knows them (read them on that thread only)."""
        return self._store.objects

    # -- applying messages ---------------------------------------------------------------------

    def drain(self, timeout: float = 0.0) -> int:
        """Apply queued messages; wait up to `timeout` for the first one. Returns how many."""
        n = 0
        try:
            message = (
                self._messages.get(timeout=timeout) if timeout > 0 else self._messages.get_nowait()
            )
        except queue.Empty:
            return 0
        while True:
            self._apply(message)
            n += 1
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return n

    def _apply(self, message: Message) -> None:
        match message:
            case Watched(kind, type_, obj):
                self._watched(kind, type_, obj)
            case Synced(kind):
                self._synced.add(kind)
            case WrittenBeside(claim):
                self._written_beside(claim)
            case ReleaseDone():
                self._releaser.done(message)
            case CommitDone():
                self._committer.done(message, self._written_beside)
            case Settled():
                self._committer.settled(message, self._written_beside)
            case LookedUp():
                self._lookup.done(message)

    def _watched(self, kind: Kind, type_: EventType, obj: Obj) -> None:
        if not self._store.apply(kind, type_, obj):
            return
        key = key_of(obj)
        if kind is Kind.POD:
            self._on_pod(key, obj, type_)
        elif kind is Kind.CLAIM:
            self._releaser.mark(key)
        elif kind is Kind.NODE:
            self._lost.node_changed()
        elif kind is Kind.CLASS:
            self._extended_names = None

    def _on_pod(self, key: str, pod: Obj, type_: EventType) -> None:
        view = PodView(pod)
        if type_ is EventType.DELETED or view.terminal:
            if view.node_name:
                self._memory.wake_all(capacity=True)  # its CPU, memory and pod slot are free
            ns = view.namespace
            self._releaser.mark_all(f"{ns}/{name}" for name in pod_claim_names(pod)[0])
            return
        self._memory.pod_changed(key)

    def _written_beside(self, claim: Obj) -> None:
        """A claim written beside the decision thread, applied as an informer's copy would be,
        if the claim is still stored (`ClusterStore.still_stored` says why)."""
        if self._store.still_stored(claim):
            self._watched(Kind.CLAIM, EventType.MODIFIED, claim)

    def _claim_written(self, claim: Obj) -> None:
        """Feed a claim this controller just wrote into the store and model before any further
        decision."""
        if self._store.put_claim(claim) and is_allocated(claim):
            self._lost.reallocated(key_of(claim))

    # -- one round -----------------------------------------------------------------------------

    def step(self, timeout: float = 0.0) -> None:
        """Apply pending messages, then (once every informer has synced) release and place."""
        self.drain(0.0 if self._memory.queue.has_due else timeout)
        # Reads that settle failed writes (`controller.settle`); reads only, so a follower
        # settles what it wrote as leader too. One read on this thread is applied at once.
        self._committer.settle_pass()
        self._lookup.read_pass()
        self.drain()
        if not self.synced:
            return
        if not self._is_leader():
            return
        self._conflicts.report(self._planner.problems())
        self._duplicates.report(self._planner.duplicate_gpus())
        self._releaser.mark_all(self._lost.node_pass())
        self._releaser.release_pass()
        self._place_pass()

    def resync(self) -> None:
        """Re-examine every claim and pod (periodic safety net against missed events)."""
        self._releaser.mark_all(self._store.claims)
        self._memory.look_again_at_all()

    # -- placement -----------------------------------------------------------------------------

    def _classify(self) -> None:
        """Classify again the pods that changed since the last pass (not every waiting pod)."""
        now = self._clock()
        claims = self._store.claims
        pods = self._store.pods
        memory = self._memory
        for key in memory.queue.take_stale():
            pod = pods.get(key)
            if pod is None or not memory.is_candidate(key):
                memory.forget(key)
                continue
            work = pod_work(pod, claims, self._cfg.classes, self._cfg.contract, self._store.foreign)
            if work.kind is WorkKind.NONE:
                memory.queue.drop(key)
                memory.end_wait(key)
                continue
            # Pods a queue still holds are not waiting for carve.
            counted = work.kind is not WorkKind.UNGATE and work.reason != GATED_ELSEWHERE
            old = memory.queue.put(key, Queued(work, priority_key(pod), counted))
            wait = memory.waiting(key, now)
            was_held = old is not None and old.work.reason == GATED_ELSEWHERE
            if was_held and work.reason != GATED_ELSEWHERE:
                wait.held_until = self._wall()  # the other gate went just now

    def _due(self) -> list[tuple[str, Obj, PodWork]]:
        pods = self._store.pods
        due = self._memory.queue.take_due(self._clock(), limit=self._cfg.visits_per_pass)
        return [(key, pods[key], q.work) for key, q in due]

    def pending(self) -> list[str]:
        """Keys of pods that still need the controller, in the order they will be served."""
        self._classify()
        return [key for key, _ in self._memory.queue.ordered()]

    def _place_pass(self) -> None:
        self._classify()
        due = self._due()
        if self._releaser.in_flight and any(self._due_for_placement(k, w) for k, _, w in due):
            for key, _, _ in due:
                self._memory.queue.wake(key)
            self._await_releases()
            self._classify()
            due = self._due()
        self._metrics.set_queue_depth(self._memory.queue.depth)
        now = self._clock()
        if self._extended_names is None:  # DeviceClasses change rarely; passes are many
            self._extended_names = resource_classes(
                self._store.objects[Kind.CLASS], self._cfg.classes
            )
        names = self._extended_names
        for i, (key, pod, work) in enumerate(due):
            if not self._is_leader():
                for later, _, _ in due[i:]:
                    self._memory.queue.wake(later)
                return
            self._visit(key, pod, work, names, now)
            self._wake_later(key, work, now)

    def _due_for_placement(self, key: str, work: PodWork) -> bool:
        """A pod this pass will try to place now (not one waiting out a retry interval)."""
        if work.kind is not WorkKind.PLACE:
            return False
        wait = self._memory.wait_of(key)
        return wait is not None and not wait.permanent and wait.retry_at <= self._clock()

    def _await_releases(self) -> None:
        """Apply messages until no release write is in flight (or `release_wait` passed), so a
        pod about to be placed sees the placements that are being freed. A pod that ended and
        a pod that arrives in the same moment are the common case at a steady rate, and the
        freed placement is where the node may have kept the slice warm."""
        deadline = time.monotonic() + self._cfg.release_wait
        while self._releaser.in_flight:
            left = deadline - time.monotonic()
            if left <= 0 or not self.drain(timeout=left):
                return

    def _visit(
        self, key: str, pod: Obj, work: PodWork, names: Mapping[str, str], now: float
    ) -> None:
        if self._committer.in_flight(key):
            return  # its writes are in flight; the commit's end decides what is next
        if self._store.any_assumed(work.claims):
            # A claim it shares with a pod being committed looks allocated but is not yet:
            # ungated now, kube-scheduler would find it unallocated and allocate it itself.
            return  # the commit's answers wake this pod (`PodMemory.wake_users`)
        wait = self._memory.waiting(key, now)
        if work.kind is WorkKind.WAIT and work.reason == GATED_ELSEWHERE:
            # Held by a queue (Kueue) for as long as it likes: said once, not every pass,
            # and the native-fallback clock starts only once the pod is carve's alone.
            wait.held_until = self._wall()
            self._outcomes.held(pod, wait, work.reason, work.message)
            return
        if work.kind is WorkKind.WAIT:
            self._lookup.want(work.missing)  # not created yet, or another driver's
            # kube-controller-manager normally creates claims within milliseconds: only a
            # wait that lasts is worth an event (and a condition write) per pod.
            if now - wait.first_seen >= self._cfg.claims_grace:
                self._outcomes.waits(pod, wait, Unplaceable("ClaimsNotReady", work.message))
            return
        if wait.retry_at > now or wait.permanent:
            return
        if work.kind is WorkKind.UNGATE and self._lost.on_lost_node(work.claims):
            # Allocated on a node that is lost: `LostNodes.release` clears it (at once, or once
            # nothing reserves it) and the pod is placed again, still gated.
            return
        try:
            if work.kind is WorkKind.UNGATE and self._carve_hold.holds(pod, wait, work.claims, now):
                return
            gated = has_gate(pod, self._cfg.gate)
            if gated and asks_carve_resources(pod, names):
                self._placer.place_extended(pod, wait, work.claims, names)
            elif work.kind is WorkKind.UNGATE:
                refused = self._planner.check_allocated(pod, work.claims)
                if refused is not None:
                    self._outcomes.waits(pod, wait, refused, work.claims)
                else:
                    self._placer.ungate(pod, work.claims)
            elif not gated:
                self._placer.replan(pod, wait, work.claims, now)
            else:
                self._placer.place(pod, wait, work.claims)
        except Exception as exc:
            self._outcomes.failed(pod, wait, work.claims, exc)

    def _wake_later(self, key: str, work: PodWork, now: float) -> None:
        """After a visit that left the pod waiting: when to look at it again by itself. Waits
        for a change (another gate, a commit in flight, a lost node, a permanent refusal) set
        no time: the change wakes the pod."""
        wait = self._memory.wait_of(key)
        if wait is None or key not in self._memory.queue or self._committer.in_flight(key):
            return
        if work.kind is WorkKind.WAIT and work.reason == GATED_ELSEWHERE:
            return
        if work.kind is WorkKind.WAIT and now - wait.first_seen < self._cfg.claims_grace:
            self._memory.queue.wake_at(key, wait.first_seen + self._cfg.claims_grace)
        elif not wait.permanent and wait.retry_at > now:
            self._memory.queue.wake_at(key, wait.retry_at)


class _NullMetrics:
    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None:
        return None

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None:
        return None

    def set_queue_depth(self, depth: int) -> None:
        return None

    def count_outcome(self, outcome: str) -> None:
        return None

    def set_conflicts(self, gpus: int) -> None:
        return None

    def set_duplicate_gpus(self, gpus: int) -> None:
        return None


def _run_now(_key: str, write: Callable[[], None]) -> None:
    write()
