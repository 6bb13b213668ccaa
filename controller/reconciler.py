"""The controller's state machine: gated pods in, allocated claims and ungated pods out.

One thread owns all decisions. Informer threads only enqueue events; `Reconciler.step` applies
them to the stores and to the planner's model, then releases what can be released and places
waiting pods one at a time, highest priority first, then oldest. Because the planner's model is
fed each claim as written (or, while its writes are in flight beside this thread, as assumed)
before the next decision, two pods can never be given the same placement, whatever the watch
latency.

The placement engine is reached through the narrow `Planner` seam so that this module knows
nothing about MIG geometry: it asks "where does this pod's set of claims go?" and gets either a
`Plan` (one `ClaimAllocation` per claim) or an `Unplaceable` explanation to show to the user.

Release follows invariant 4: an allocation is cleared only when the claim is reserved for nobody,
no live pod uses it, and no node finalizer (`Contract.node_finalizer`, the kubelet plugin's)
remains, which means the node has destroyed the MIG instance.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from controller.config import ReconcilerConfig
from controller.extended_resources import (
    ExtendedResourceError,
    PinnedPods,
    asks_carve_resources,
    extended_stand_in,
    in_users_words,
    resource_classes,
)
from controller.messages import (
    CommitDone,
    Message,
    ReleaseDone,
    Synced,
    Watched,
    WrittenBeside,
)
from controller.nodehealth.carvewait import CarveState, carve_verdict, plan_waits_for_carve
from controller.nodehealth.signals import NodeLoss, allocated_node, node_loss, not_ready_deadline
from controller.objects import (
    ClaimAllocation,
    EventType,
    Kind,
    Obj,
    Plan,
    Unplaceable,
    claim_class_names,
    has_finalizer,
    has_gate,
    is_allocated,
    is_older,
    is_terminal,
    key_of,
    node_finalizers,
    pod_claim_names,
    priority_key,
)
from controller.podqueue import PodQueue, Queued
from controller.seams import ClaimWriter, Metrics, Planner, PreemptionHook, Recorder
from controller.status import ObjectGoneError, WriteSkippedError, build_allocation_status
from controller.work import GATED_ELSEWHERE, PodWork, WorkKind, may_need_work, pod_work
from driver.contract import DEFAULT_CONTRACT, Contract

_log = logging.getLogger(__name__)


class _NullMetrics:
    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None:
        return None

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None:
        return None

    def set_queue_depth(self, depth: int) -> None:
        return None

    def count_outcome(self, outcome: str) -> None:
        return None


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


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
    status = claim.get("status", {})
    deleting = bool(claim.get("metadata", {}).get("deletionTimestamp"))
    if status.get("reservedFor"):
        return ReleaseKind.KEEP
    if not deleting and live_consumers > 0:
        return ReleaseKind.KEEP
    if node_finalizers(claim, contract):
        return ReleaseKind.WAIT_NODE
    if is_allocated(claim) and not deleting:
        return ReleaseKind.CLEAR
    return ReleaseKind.DROP_FINALIZER


# --------------------------------------------------------------------------------------------
# The reconciler
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Commit:
    """A placement whose writes are in flight beside the decision thread.

    Until they land, the store holds an *assumed* copy of each claim (ours: the finalizer and
    the allocation the writes will give it), so the model counts the placement as taken and no
    later decision hands it out again, whatever the watch latency."""

    plan: Plan
    claims: tuple[Obj, ...]
    assumed: Mapping[str, Obj]  # claim key -> the assumed copy put in the store
    first_seen: float
    writing: tuple[ClaimAllocation, ...]  # the plan's allocations not yet written before


@dataclass
class _PodState:
    first_seen: float
    last_message: str = ""
    attempts: int = 0
    retry_at: float = 0.0
    permanent: bool = False
    # When the controller saw another scheduling gate go (or last saw one hold the pod).
    held_until: dt.datetime | None = None
    # The planner's last refusal, before preemption added to it (`Planner.plan`'s `told`).
    refused: Unplaceable | None = None


class Reconciler:
    """Owns the stores, the planner's model and every write. Call `step` from one thread only."""

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
        defer: Callable[[str, Callable[[], None]], None] | None = None,
        preemption: PreemptionHook | None = None,
        release_beside: Callable[[str, Callable[[], None]], bool] | None = None,
        commit_beside: Callable[[str, Callable[[], None]], bool] | None = None,
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
        self._planner = planner
        self._preemption = preemption
        self._defer = defer or _run_now
        self._release_beside = release_beside
        self._releasing: set[str] = set()  # claims whose release writes are in flight beside
        self._commit_beside = commit_beside
        self._committing: dict[str, _Commit] = {}  # pod key -> its commit in flight
        # Claim key -> the newest copy the informer gave of a claim held assumed meanwhile.
        self._assumed: dict[str, Obj] = {}
        self._writer = writer
        self._recorder = recorder
        self._cfg = config or ReconcilerConfig()
        self._metrics: Metrics = metrics or _NullMetrics()
        self._is_leader = is_leader
        self._clock = clock
        self._wall = wall_clock
        self._events: queue.Queue[Message] = queue.Queue()
        self._synced: set[Kind] = set()
        self.stores: dict[Kind, dict[str, Obj]] = {k: {} for k in Kind}
        self._pods: dict[str, _PodState] = {}
        # Pods for which `pod_work` can be anything but NONE: only these are classified, not
        # every pod the cache holds (bound and foreign pods never need the controller).
        self._candidates: set[str] = set()
        # Their classifications, and which of them the next pass visits (controller.podqueue).
        self._queue: PodQueue[PodWork] = PodQueue()
        self._extended_names: dict[str, str] | None = None  # resource_classes(), per class change
        self._dirty_claims: set[str] = set()
        self._event_sent: dict[str, dict[str, float]] = {}
        # Ungated pods whose allocation kube-scheduler cleared: how often, and when to retry.
        self._replans: dict[str, tuple[int, float]] = {}
        self._users: dict[str, set[str]] = {}  # claim key -> keys of live pods using it
        self._uses: dict[str, set[str]] = {}  # pod key -> claim keys it uses
        # Lost nodes (controller/nodehealth/signals.py): the last verdict per node that claims are
        # allocated to, when to look again (a NotReady node's grace ends), which claims this
        # controller cleared because of a loss (their pods are re-planned, not "rejected"), and
        # the last loss message told per claim (told once, not every pass).
        self._lost: dict[str, NodeLoss] = {}
        self._nodes_changed = True
        self._next_loss_check: dt.datetime | None = None
        self._lost_cleared: dict[str, NodeLoss] = {}
        self._pinned = PinnedPods()
        self._loss_told: dict[str, str] = {}
        self._carve_failures: dict[str, int] = {}  # pod key -> failed carves while gated

    # -- input (any thread) ----------------------------------------------------------------------

    def enqueue(self, kind: Kind, type_: EventType, obj: Obj) -> None:
        self._events.put(Watched(kind, type_, obj))

    def mark_synced(self, kind: Kind) -> None:
        self._events.put(Synced(kind))

    @property
    def synced(self) -> bool:
        return self._synced >= set(Kind)

    # -- event application ------------------------------------------------------------------------

    def _apply(self, message: Message) -> None:
        match message:
            case Watched(kind, type_, obj):
                self._watched(kind, type_, obj)
            case Synced(kind):
                self._synced.add(kind)
            case WrittenBeside(claim):
                self._written_beside(claim)
            case ReleaseDone(claim_key):
                # Look again: a failed write is retried, a finished one may have a next step.
                self._releasing.discard(claim_key)
                self._dirty_claims.add(claim_key)
            case CommitDone():
                self._commit_done(message)

    def _written_beside(self, claim: Obj) -> None:
        """A claim written beside the decision thread, applied as an informer's copy would be,
        if the claim is still stored (`_still_stored` says why)."""
        if self._still_stored(claim):
            self._watched(Kind.CLAIM, EventType.MODIFIED, claim)

    def _watched(self, kind: Kind, type_: EventType, obj: Obj) -> None:
        key = key_of(obj)
        if kind is Kind.CLAIM and key in self._assumed and self._keeps_assumption(type_, obj):
            return
        store = self.stores[kind]
        if type_ is EventType.DELETED:
            old = store.pop(key, None)
            self._planner.forget(kind, old or obj)
        else:
            old = store.get(key)
            if is_older(obj, old):
                return
            store[key] = obj
            self._planner.observe(kind, obj)
        if kind is Kind.POD:
            self._queue.changed(key)
            self._index_pod(key, None if type_ is EventType.DELETED else obj)
            self._index_candidate(key, None if type_ is EventType.DELETED else obj)
            self._on_pod(key, obj, type_)
        elif kind is Kind.CLAIM:
            self._dirty_claims.add(key)
            self._wake_pods_of_claim(obj)
            if type_ is EventType.DELETED or _allocation_dropped(old, obj):
                self._wake_all(capacity=True)
        else:
            if kind is Kind.NODE:
                self._nodes_changed = True
            elif kind is Kind.CLASS:
                self._extended_names = None
            self._wake_all(capacity=kind is not Kind.CLASS, classes=kind is Kind.CLASS)

    def _on_pod(self, key: str, pod: Obj, type_: EventType) -> None:
        if type_ is EventType.DELETED or is_terminal(pod) or pod.get("spec", {}).get("nodeName"):
            self._replans.pop(key, None)
            self._carve_failures.pop(key, None)
        if type_ is EventType.DELETED or is_terminal(pod):
            self._forget_pod(key)
            if pod.get("spec", {}).get("nodeName"):
                self._wake_all(capacity=True)  # its CPU, memory and pod slot are free again
            ns = pod.get("metadata", {}).get("namespace", "")
            for name in pod_claim_names(pod)[0]:
                self._dirty_claims.add(f"{ns}/{name}")
            return
        state = self._pods.get(key)
        if state is not None:
            state.retry_at = 0.0
            state.permanent = False

    def _index_pod(self, key: str, pod: Obj | None) -> None:
        """Keep claim -> live pods current, so release decisions do not scan every pod."""
        for claim_key in self._uses.pop(key, ()):
            users = self._users.get(claim_key)
            if users is not None:
                users.discard(key)
                if not users:
                    del self._users[claim_key]
        if pod is None or is_terminal(pod):
            return
        ns = pod.get("metadata", {}).get("namespace", "")
        claim_keys = {f"{ns}/{name}" for name in pod_claim_names(pod)[0]}
        if claim_keys:
            self._uses[key] = claim_keys
            for claim_key in claim_keys:
                self._users.setdefault(claim_key, set()).add(key)

    def _index_candidate(self, key: str, pod: Obj | None) -> None:
        if pod is not None and may_need_work(pod, self._cfg.gate):
            self._candidates.add(key)
        elif key in self._candidates:
            self._candidates.discard(key)
            self._queue.drop(key)
            self._drop_state(key)

    def _set_pod(self, key: str, pod: Obj) -> None:
        """Store a pod this controller just wrote."""
        self.stores[Kind.POD][key] = pod
        self._queue.changed(key)
        self._index_candidate(key, pod)

    def _condition(self, pod: Obj, status: bool, reason: str, message: str) -> None:
        """Best effort, like events: a failed condition write never blocks a decision."""

        def write() -> None:
            try:
                self._writer.set_pod_condition(pod, status, reason, message)
            except Exception as exc:
                _log.info("pod %s: could not set condition: %s", key_of(pod), exc)

        self._defer(key_of(pod), write)

    def _forget_pod(self, key: str) -> None:
        """The pod needs nothing more from us: drop its queue state and event memory, and
        classify it afresh should it still need something (its next change says what)."""
        self._drop_state(key)
        self._queue.changed(key)

    def _drop_state(self, key: str) -> None:
        self._pods.pop(key, None)
        self._event_sent.pop(key, None)

    def _claim_changed(self, claim_key: str) -> None:
        """A claim changed in the store: the pods that name it are classified again."""
        for pod_key in self._users.get(claim_key, ()):
            self._queue.changed(pod_key)

    def _wake_pods_of_claim(self, claim: Obj) -> None:
        key = key_of(claim)
        self._claim_changed(key)
        for pod_key in self._users.get(key, ()):
            state = self._pods.get(pod_key)
            if state is not None:
                state.retry_at = 0.0
                state.permanent = False

    def _wake_all(self, *, capacity: bool = False, classes: bool = False) -> None:
        """Capacity changes retry pods that lacked room; class changes also retry bad claims."""
        for key, state in self._pods.items():
            if (capacity and not state.permanent) or classes:
                state.retry_at = 0.0
                state.permanent = False
                self._queue.wake(key)

    def drain(self, timeout: float = 0.0) -> int:
        """Apply queued events; wait up to `timeout` for the first one. Returns how many."""
        n = 0
        try:
            item = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return 0
        while True:
            self._apply(item)
            n += 1
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return n

    # -- one round ----------------------------------------------------------------------------

    def step(self, timeout: float = 0.0) -> None:
        """Apply pending events, then (once every informer has synced) release and place."""
        self.drain(timeout)
        if not self.synced:
            return
        if not self._is_leader():
            return
        self._node_pass()
        self._release_pass()
        self._place_pass()

    def resync(self) -> None:
        """Re-examine every claim and pod (periodic safety net against missed events)."""
        self._dirty_claims.update(self.stores[Kind.CLAIM])
        for state in self._pods.values():
            state.retry_at = 0.0
        for key in self._candidates:  # every pod the queue holds is a candidate
            self._queue.changed(key)

    # -- release (invariant 4) --------------------------------------------------------------------

    def _live_consumers(self, claim: Obj) -> int:
        return len(self._users.get(key_of(claim), ()))

    def _release_pass(self) -> None:
        dirty, self._dirty_claims = self._dirty_claims, set()
        now = self._wall()
        for key in sorted(dirty):
            claim = self.stores[Kind.CLAIM].get(key)
            if claim is None:
                self._loss_told.pop(key, None)
                continue
            if key in self._releasing or key in self._assumed:
                continue  # its writes are in flight; their completion marks it dirty again
            loss = self._claim_loss(claim, now)
            try:
                if loss is not None:
                    self._release_lost(claim, loss)
                    continue
                action = release_action(claim, self._live_consumers(claim), self._cfg.contract)
                if action in (ReleaseKind.CLEAR, ReleaseKind.DROP_FINALIZER) and (
                    self._release_elsewhere(claim, action)
                ):
                    continue
                self._release(claim, action)
            except (WriteSkippedError, ObjectGoneError) as exc:
                _log.info("release of claim %s skipped: %s", key, exc)
            except Exception:
                _log.exception("release of claim %s failed; will retry", key)
                self._dirty_claims.add(key)

    def _due_for_placement(self, key: str, w: PodWork) -> bool:
        """A pod this pass will try to place now (not one waiting out a retry interval)."""
        if w.kind is not WorkKind.PLACE:
            return False
        state = self._pods.get(key)
        return state is not None and not state.permanent and state.retry_at <= self._clock()

    def _await_releases(self) -> None:
        """Apply events until no release write is in flight (or `release_wait` passed), so a
        pod about to be placed sees the placements that are being freed. A pod that ended and
        a pod that arrives in the same moment are the common case at a steady rate, and the
        freed placement is where the node may have kept the slice warm."""
        deadline = time.monotonic() + self._cfg.release_wait
        while self._releasing:
            left = deadline - time.monotonic()
            if left <= 0 or not self.drain(timeout=left):
                return

    def _release_elsewhere(self, claim: Obj, action: ReleaseKind) -> bool:
        """Hand the claim's release writes to `release_beside`; False if it took nothing."""
        if self._release_beside is None:
            return False
        key = key_of(claim)

        def writes() -> None:
            try:
                self._release(claim, action, self._queue_written)
            except (WriteSkippedError, ObjectGoneError) as exc:
                _log.info("release of claim %s skipped: %s", key, exc)
            except Exception:
                _log.exception("release of claim %s failed; will retry", key)
            finally:
                self._events.put(ReleaseDone(key))

        self._releasing.add(key)
        if self._release_beside(key, writes):
            return True
        self._releasing.discard(key)
        return False

    def _queue_written(self, claim: Obj) -> None:
        """A claim written beside the decision thread: into the queue, as an informer event."""
        self._events.put(WrittenBeside(claim))

    def _still_stored(self, written: Obj) -> bool:
        """Whether a claim written beside the decision thread may go into the store.

        Its copy reaches the queue only once the write's response is back, and the informer's
        later events about the claim can be applied first, its deletion included: dropping the
        last finalizer of a deleted claim deletes it, and the apiserver answers with the claim
        as it was, allocated. Stored after the deletion, that copy would hold its placement in
        the model for good. So only a claim still stored, as the same object, takes it (and
        `_older` keeps a newer informer copy over it)."""
        old = self.stores[Kind.CLAIM].get(key_of(written))
        uid = written.get("metadata", {}).get("uid")
        return old is not None and old.get("metadata", {}).get("uid") == uid

    def _release(
        self, claim: Obj, action: ReleaseKind, store: Callable[[Obj], None] | None = None
    ) -> None:
        key = key_of(claim)
        store = store or self._store_claim
        if action is ReleaseKind.CLEAR:
            fresh = self._writer.clear_allocation(claim)
            store(fresh)
            _log.info("released allocation of claim %s", key, extra={"claim": key})
            self._recorder.event(
                claim,
                Kind.CLAIM,
                "Normal",
                "Released",
                "node confirmed teardown; allocation cleared",
            )
            action = ReleaseKind.DROP_FINALIZER
            claim = fresh
        if action is ReleaseKind.DROP_FINALIZER:
            fresh = self._writer.remove_finalizer(claim)
            store(fresh)
            _log.info("removed controller finalizer from claim %s", key, extra={"claim": key})

    # -- lost nodes ----------------------------------------------------------------------------

    def _loss_of(self, node: str, now: dt.datetime) -> NodeLoss | None:
        return node_loss(node, self.stores[Kind.NODE].get(node), now, self._cfg.node_loss_grace)

    def _claim_loss(self, claim: Obj, now: dt.datetime) -> NodeLoss | None:
        node = allocated_node(claim)
        return None if node is None else self._loss_of(node, now)

    def _node_pass(self) -> None:
        """Notice nodes that became lost (a Node event, or a NotReady node's grace ran out)
        and queue every claim allocated there for `_release_lost`."""
        now = self._wall()
        due = self._next_loss_check is not None and now >= self._next_loss_check
        if not (self._nodes_changed or due):
            return
        self._nodes_changed = False
        self._next_loss_check = None
        by_node: dict[str, list[str]] = {}
        for key, claim in self.stores[Kind.CLAIM].items():
            node = allocated_node(claim)
            if node is not None:
                by_node.setdefault(node, []).append(key)
        lost: dict[str, NodeLoss] = {}
        for node, keys in sorted(by_node.items()):
            loss = self._loss_of(node, now)
            if loss is None:
                obj = self.stores[Kind.NODE].get(node)
                deadline = not_ready_deadline(obj, self._cfg.node_loss_grace) if obj else None
                if deadline is not None:
                    deadline += dt.timedelta(seconds=1)
                    if self._next_loss_check is None or deadline < self._next_loss_check:
                        self._next_loss_check = deadline
                continue
            lost[node] = loss
            before = self._lost.get(node)
            if before is None or before.signal is not loss.signal:
                _log.warning(
                    "%s; %d claim(s) allocated there",
                    loss.describe(),
                    len(keys),
                    extra={"node": node},
                )
                self._dirty_claims.update(keys)
        for node in sorted(self._lost.keys() - lost.keys()):
            _log.info("node %s is no longer lost", node, extra={"node": node})
        self._lost = lost

    def _blocks_loss_release(self, pod: Obj, loss: NodeLoss) -> bool:
        """Whether a live pod that uses a claim on a lost node may still be using its instance.

        Pods not yet bound never ran there. A pod bound to the lost node stops counting on a
        strong signal (the node is gone or out of service, its workloads stopped, exactly what
        Kubernetes assumes for non-graceful node shutdown), even while it still shows as
        Running or Terminating; on NotReady alone it keeps counting, terminating or not.
        """
        bound = (pod.get("spec") or {}).get("nodeName")
        if not bound:
            return False
        return not (loss.strong and bound == loss.node)

    def _release_lost(self, claim: Obj, loss: NodeLoss) -> None:
        """A claim allocated to a lost node: free what can be freed safely, say what and why.

        1. The node finalizer (the node prepared the claim) is removed on a strong signal only,
           once no pod that may still run there uses the claim.
        2. Then the allocation is cleared as soon as nothing reserves the claim (kube-controller-
           manager drops deleted pods from `reservedFor`), which frees the placement in the
           model; pods not yet bound are placed again elsewhere, so the controller's finalizer
           stays while such a pod waits.
        """
        key = key_of(claim)
        contract = self._cfg.contract
        node_fin = contract.node_finalizer(loss.node)
        pods = self.stores[Kind.POD]
        users = [pods[p] for p in sorted(self._users.get(key, ())) if p in pods]
        blocking = [key_of(p) for p in users if self._blocks_loss_release(p, loss)]
        movable = [
            key_of(p)
            for p in users
            if not (p.get("spec") or {}).get("nodeName")
            and not p.get("metadata", {}).get("deletionTimestamp")
        ]
        prepared = has_finalizer(claim, node_fin)
        if blocking:
            if prepared:
                self._tell_loss(
                    claim,
                    f"{loss.describe()}; the claim keeps its placement while pod "
                    f"{', '.join(blocking)} may still run there",
                )
            return
        if prepared:
            if not loss.strong:
                self._tell_loss(
                    claim,
                    f"{loss.describe()}; no new placements go there, but its MIG instance may "
                    "still exist, so the claim keeps its placement until the node is Ready "
                    "again, is deleted, or is tainted node.kubernetes.io/out-of-service",
                )
                return
            claim = self._writer.remove_node_finalizer(claim, node_fin)
            self._store_claim(claim)
            self._recorder.event(
                claim,
                Kind.CLAIM,
                "Warning",
                "NodeLost",
                f"{loss.describe()}: its MIG instance counts as destroyed; "
                f"removed the node finalizer {node_fin}",
            )
            _log.warning(
                "claim %s: removed node finalizer %s (%s)",
                key,
                node_fin,
                loss.detail,
                extra={"claim": key, "node": loss.node},
            )
        if not has_finalizer(claim, self._cfg.finalizer) or node_finalizers(claim, contract):
            return  # not ours to clear, or another node's instance is still there
        if claim.get("status", {}).get("reservedFor"):
            return  # kube-controller-manager drops deleted pods; the claim event brings us back
        deleting = bool(claim.get("metadata", {}).get("deletionTimestamp"))
        if is_allocated(claim):
            claim = self._writer.clear_allocation(claim)
            self._store_claim(claim)
            self._lost_cleared[key] = loss
            then = (
                f"; pod {', '.join(movable)} will be placed on another node"
                if movable and not deleting
                else ""
            )
            self._recorder.event(
                claim,
                Kind.CLAIM,
                "Warning",
                "NodeLost",
                f"{loss.describe()}: allocation cleared, its placement is free{then}",
            )
            _log.info(
                "claim %s: allocation on lost node %s cleared",
                key,
                loss.node,
                extra={"claim": key, "node": loss.node},
            )
        if deleting or not movable:
            self._store_claim(self._writer.remove_finalizer(claim))
            self._lost_cleared.pop(key, None)
        self._loss_told.pop(key, None)

    def _tell_loss(self, claim: Obj, message: str) -> None:
        key = key_of(claim)
        if self._loss_told.get(key) == message:
            return
        self._loss_told[key] = message
        self._recorder.event(claim, Kind.CLAIM, "Warning", "NodeLost", message)

    def _on_lost_node(self, claims: Sequence[Obj]) -> bool:
        now = self._wall()
        return any(self._claim_loss(c, now) is not None for c in claims)

    def _store_claim(self, claim: Obj) -> None:
        """Feed a claim we just wrote into the store and model before any further decision."""
        key = key_of(claim)
        old = self.stores[Kind.CLAIM].get(key)
        if is_older(claim, old):
            return
        self.stores[Kind.CLAIM][key] = claim
        self._planner.observe(Kind.CLAIM, claim)
        self._claim_changed(key)
        if is_allocated(claim):
            self._lost_cleared.pop(key, None)
        if _allocation_dropped(old, claim):
            self._wake_all(capacity=True)

    # -- placement --------------------------------------------------------------------------------

    def _classify(self) -> None:
        """Classify again the pods that changed since the last pass (not every waiting pod)."""
        now = self._clock()
        claims = self.stores[Kind.CLAIM]
        pods = self.stores[Kind.POD]
        for key in self._queue.take_stale():
            pod = pods.get(key)
            if pod is None or key not in self._candidates:
                self._candidates.discard(key)
                self._queue.drop(key)
                self._drop_state(key)
                continue
            w = pod_work(pod, claims, self._cfg.classes, self._cfg.contract)
            if w.kind is WorkKind.NONE:
                self._queue.drop(key)
                self._drop_state(key)
                continue
            # Pods a queue still holds are not waiting for carve.
            counted = w.kind is not WorkKind.UNGATE and w.reason != GATED_ELSEWHERE
            old = self._queue.put(key, Queued(w, priority_key(pod), counted))
            state = self._pods.setdefault(key, _PodState(first_seen=now))
            was_held = old is not None and old.work.reason == GATED_ELSEWHERE
            if was_held and w.reason != GATED_ELSEWHERE:
                state.held_until = self._wall()  # the other gate went just now

    def _due(self) -> list[tuple[str, Obj, PodWork]]:
        pods = self.stores[Kind.POD]
        return [(key, pods[key], q.work) for key, q in self._queue.take_due(self._clock())]

    def pending(self) -> list[str]:
        """Keys of pods that still need the controller, in the order they will be served."""
        self._classify()
        return [key for key, _ in self._queue.ordered()]

    def _place_pass(self) -> None:
        self._classify()
        work = self._due()
        if self._releasing and any(self._due_for_placement(key, w) for key, _, w in work):
            for key, _, _ in work:
                self._queue.wake(key)
            self._await_releases()
            self._classify()
            work = self._due()
        self._metrics.set_queue_depth(self._queue.depth)
        now = self._clock()
        if self._extended_names is None:  # DeviceClasses change rarely; passes are many
            self._extended_names = resource_classes(self.stores[Kind.CLASS], self._cfg.classes)
        names = self._extended_names
        for i, (key, pod, w) in enumerate(work):
            if not self._is_leader():
                for later, _, _ in work[i:]:
                    self._queue.wake(later)
                return
            self._visit(key, pod, w, names, now)
            self._wake_later(key, w, now)

    def _visit(self, key: str, pod: Obj, w: PodWork, names: Mapping[str, str], now: float) -> None:
        if key in self._committing:
            return  # its writes are in flight; the commit's end decides what is next
        if self._assumed and any(key_of(c) in self._assumed for c in w.claims):
            # A claim it shares with a pod being committed looks allocated but is not yet:
            # ungated now, kube-scheduler would find it unallocated and allocate it itself.
            return  # the commit's answers wake this pod (`_wake_pods_of_claim`)
        state = self._pods.setdefault(key, _PodState(first_seen=now))
        if w.kind is WorkKind.WAIT and w.reason == GATED_ELSEWHERE:
            # Held by a queue (Kueue) for as long as it likes: said once, not every pass,
            # and the native-fallback clock starts only once the pod is carve's alone.
            state.held_until = self._wall()
            if state.last_message != w.message:
                state.last_message = w.message
                self._recorder.event(pod, Kind.POD, "Normal", w.reason, w.message)
                self._condition(pod, False, w.reason, w.message)
            return
        if w.kind is WorkKind.WAIT:
            # kube-controller-manager normally creates claims within milliseconds: only a
            # wait that lasts is worth an event (and a condition write) per pod.
            if now - state.first_seen >= self._cfg.claims_grace:
                self._wait(pod, state, Unplaceable("ClaimsNotReady", w.message))
            return
        if state.retry_at > now or state.permanent:
            return
        if w.kind is WorkKind.UNGATE and self._on_lost_node(w.claims):
            # Allocated on a node that is lost: `_release_lost` clears it (at once, or once
            # nothing reserves it) and the pod is placed again, still gated.
            return
        try:
            if w.kind is WorkKind.UNGATE and self._held_for_carve(pod, state, w.claims, now):
                return
            gated = has_gate(pod, self._cfg.gate)
            if gated and asks_carve_resources(pod, names):
                self._place_extended(pod, state, w.claims, names)
            elif w.kind is WorkKind.UNGATE:
                refused = self._planner.check_allocated(pod, w.claims)
                if refused is not None:
                    self._wait(pod, state, refused, w.claims)
                else:
                    self._ungate(pod, w.claims)
            elif not gated:
                self._replan(pod, state, w.claims, now)
            else:
                self._place(pod, state, w.claims)
        except Exception as exc:
            self._placement_failed(pod, state, w.claims, exc)

    def _wake_later(self, key: str, w: PodWork, now: float) -> None:
        """After a visit that left the pod waiting: when to look at it again by itself. Waits
        for a change (another gate, a commit in flight, a lost node, a permanent refusal) set
        no time: the change wakes the pod."""
        state = self._pods.get(key)
        if state is None or key not in self._queue or key in self._committing:
            return
        if w.kind is WorkKind.WAIT and w.reason == GATED_ELSEWHERE:
            return
        if w.kind is WorkKind.WAIT and now - state.first_seen < self._cfg.claims_grace:
            self._queue.wake_at(key, state.first_seen + self._cfg.claims_grace)
        elif not state.permanent and state.retry_at > now:
            self._queue.wake_at(key, state.retry_at)

    def _decide(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        classes: Mapping[str, Obj],
        told: Unplaceable | None = None,
    ) -> Plan | Unplaceable:
        """The planner's verdict, timed twice: wall time is what the pod waits, this thread's
        CPU time is what the engine costs; the gap is time the thread did not run (the CPU or
        the GIL held elsewhere), which tells an operator a busy machine from a slow engine.
        A refusal shared with a like pod (`told` back) was no decision and is not timed."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        verdict: Plan | Unplaceable | None = None
        try:
            verdict = self._planner.plan(pod, claims, classes, told)
            return verdict
        finally:
            if told is None or verdict is not told:
                self._metrics.observe_decision(
                    time.perf_counter() - started, time.thread_time() - cpu_started
                )

    def _placement_failed(
        self, pod: Obj, state: _PodState, claims: Sequence[Obj], exc: Exception
    ) -> None:
        key, now = key_of(pod), self._clock()
        if isinstance(exc, WriteSkippedError | ObjectGoneError):
            _log.info("pod %s: %s; will look again", key, exc, extra={"pod": key})
            state.retry_at = now + 1.0
            return
        _log.error("pod %s: placement failed; will retry", key, exc_info=exc, extra={"pod": key})
        state.attempts += 1
        state.retry_at = now + min(30.0, 0.5 * 2**state.attempts)
        # Not only a log line: the user reads pods and claims, not the controller log.
        why = _write_failure(exc)
        state.permanent = why.permanent
        self._tell(pod, state, claims, why)

    def _place_extended(
        self, pod: Obj, state: _PodState, claims: Sequence[Obj], names: Mapping[str, str]
    ) -> None:
        """A pod asking through extended resources: carve's best fit picks the node, the pod is
        pinned there and ungated, and kube-scheduler allocates its claim on that node
        (`controller.extended_resources` says why carve cannot write that allocation itself)."""
        try:
            stand_in = extended_stand_in(pod, claims, names)
        except ExtendedResourceError as exc:
            self._wait(pod, state, Unplaceable(exc.reason, str(exc), permanent=True), claims)
            return
        verdict = self._decide(pod, [stand_in], self.stores[Kind.CLASS])
        if isinstance(verdict, Unplaceable):
            self._metrics.count_outcome("unplaceable")
            message = in_users_words(verdict.message, pod, names)
            self._wait(pod, state, replace(verdict, message=message))
            return
        if self._held_for_pinned(pod, state, verdict.node):
            return
        key = key_of(pod)
        self._set_pod(key, self._writer.pin_and_ungate(pod, verdict.node))
        self._pinned.pin(key, pod["metadata"].get("uid", ""), verdict.node, self._clock())
        self._planner.committed(pod, verdict)
        self._metrics.count_outcome("allocated")
        chosen = ", ".join(
            f"{r.request}={r.pool}/{r.device}" for a in verdict.allocations for r in a.results
        )
        message = (
            f"carve's best fit chose node {verdict.node} (its best devices there: {chosen}); "
            "the pod is pinned to that node, where kube-scheduler allocates its extended "
            "resources (first fit in published order)"
        )
        self._recorder.event(pod, Kind.POD, "Normal", "Placed", message)
        self._condition(pod, True, "Placed", message)
        _log.info("pod %s pinned to %s", key, verdict.node, extra={"pod": key})
        self._forget_pod(key)

    def _held_for_pinned(self, pod: Obj, state: _PodState, node: str) -> bool:
        """Whether a decision on `node` must wait for a pod pinned there (`PinnedPods`)."""
        key, now = key_of(pod), self._clock()
        blocker = self._pinned.blocker(
            node, key, now, self.stores[Kind.POD], self.stores[Kind.CLAIM]
        )
        if blocker is None:
            return False
        _log.info(
            "pod %s: node %s waits for kube-scheduler's allocation of pinned pod %s",
            key,
            node,
            blocker,
            extra={"pod": key, "node": node},
        )
        state.retry_at = now + 0.5
        return True

    def _replan(self, pod: Obj, state: _PodState, claims: Sequence[Obj], now: float) -> None:
        """Allocate again after kube-scheduler's PostFilter cleared an allocation of ours.

        The scheduler does that when the pod fits no node, including the one carve chose (for
        instance because of a resource carve does not model, or a node change in between).
        Re-planning at once could loop forever, so each round waits longer, and after
        `max_replans` rounds the pod is left to kube-scheduler's own allocator.
        """
        key = key_of(pod)
        losses = [self._lost_cleared.pop(key_of(c), None) for c in claims]
        lost = [loss for loss in losses if loss is not None]
        if lost:
            # Not kube-scheduler's doing: the node went away before the pod was bound there.
            self._recorder.event(
                pod,
                Kind.POD,
                "Warning",
                "NodeLost",
                f"{lost[0].describe()} before this pod was bound there; placing its claims again",
            )
            self._place(pod, state, claims)
            return
        rounds, not_before = self._replans.get(key, (0, 0.0))
        if now < not_before:
            state.retry_at = not_before
            return
        if rounds >= self._cfg.max_replans:
            self._replans.pop(key, None)
            self._release_to_scheduler(
                pod,
                "SchedulerRejectedPlacement",
                f"kube-scheduler cleared carve's allocation {rounds} times "
                f"({_scheduling_message(pod) or 'the pod fits no node'}); "
                "leaving the allocation to kube-scheduler",
            )
            return
        self._replans[key] = (rounds + 1, now + min(60.0, 2.0 ** (rounds + 1)))
        self._recorder.event(
            pod,
            Kind.POD,
            "Warning",
            "AllocationCleared",
            "kube-scheduler cleared the allocation of this pod's claims "
            f"({_scheduling_message(pod) or 'no reason given'}); placing again",
        )
        self._place(pod, state, claims)

    def _held_for_carve(
        self, pod: Obj, state: _PodState, claims: Sequence[Obj], now: float
    ) -> bool:
        """Keep the gate while the node carves; on a failed carve clear and place again.
        False: ungate now (nothing to wait for, carved, or the wait is over)."""
        if not self._cfg.hold_gate_until_carved:
            return False
        verdict = carve_verdict(claims, self._cfg.driver, self._wall(), self._cfg.carve_wait)
        key = key_of(pod)
        if verdict.state is CarveState.PENDING:
            state.retry_at = now + min(1.0, verdict.wait_left)  # claim events wake it sooner
            return True
        if verdict.state is CarveState.TIMED_OUT:
            self._recorder.event(
                pod,
                Kind.POD,
                "Warning",
                "CarveNotReported",
                f"no carve reported for {', '.join(verdict.waiting_for)} within "
                f"{self._cfg.carve_wait:g}s; ungated, kube-scheduler waits for it (is "
                "carve-kubelet-plugin running on that node? its /readyz names a claim watch "
                "that fails)",
            )
        if verdict.state is not CarveState.FAILED:
            self._carve_failures.pop(key, None)
            return False
        why = "; ".join(f"{f.device}: {f.message}" for f in verdict.failures)
        done = self._carve_failures.get(key, 0)
        if done >= self._cfg.max_replans:
            # Placed again max_replans times and every carve failed: keep what we have and
            # say so, rather than loop on a claim that no GPU can carve.
            state.retry_at = now + self._cfg.retry_interval
            refused = Unplaceable("CarveFailed", f"carve failed {done + 1} times: {why}")
            self._tell(pod, state, claims, refused)
            return True
        failed = {f.claim for f in verdict.failures}
        clearable = [
            c for c in claims if key_of(c) in failed and not node_finalizers(c, self._cfg.contract)
        ]
        if not clearable:
            state.retry_at = now + 1.0  # the node is still tearing the failed carve down
            return True
        self._carve_failures[key] = done + 1
        for claim in clearable:
            self._store_claim(self._writer.clear_allocation(claim))
            self._recorder.event(
                claim, Kind.CLAIM, "Warning", "CarveFailed", f"{why}; placing again"
            )
        message = f"the node could not carve: {why}; placing again"
        self._recorder.event(pod, Kind.POD, "Warning", "CarveFailed", message)
        state.retry_at = now  # unallocated now: place it again
        return True

    def _release_to_scheduler(self, pod: Obj, reason: str, message: str) -> None:
        """Drop our finalizer from the pod's unallocated claims: kube-scheduler owns them now."""
        ns = pod.get("metadata", {}).get("namespace", "")
        for name in pod_claim_names(pod)[0]:
            claim = self.stores[Kind.CLAIM].get(f"{ns}/{name}")
            if (
                claim is not None
                and not is_allocated(claim)
                and has_finalizer(claim, self._cfg.finalizer)
            ):
                self._store_claim(self._writer.remove_finalizer(claim))
        self._forget_pod(key_of(pod))
        self._metrics.count_outcome("native-fallback")
        self._recorder.event(pod, Kind.POD, "Warning", reason, message)

    def _ungate(self, pod: Obj, claims: Sequence[Obj]) -> None:
        key = key_of(pod)
        if has_gate(pod, self._cfg.gate):
            self._set_pod(key, self._writer.remove_gate(pod))
        self._forget_pod(key)
        if claims:
            _log.info("pod %s: claims already allocated; gate removed", key, extra={"pod": key})
        else:
            _log.info("pod %s: no carve claims; gate removed", key, extra={"pod": key})

    def _place(self, pod: Obj, state: _PodState, claims: Sequence[Obj]) -> None:
        key = key_of(pod)
        classes = self.stores[Kind.CLASS]
        missing = sorted(
            {
                n
                for c in claims
                for n in claim_class_names(c)
                if n not in classes and n in self._cfg.classes
            }
        )
        if missing:
            verdict: Plan | Unplaceable = Unplaceable(
                "UnknownDeviceClass",
                f"DeviceClass {', '.join(missing)} does not exist",
                permanent=True,
            )
        else:
            try:
                verdict = self._decide(pod, claims, classes, told=state.refused)
            except Exception as exc:
                _log.exception("planner failed for pod %s", key, extra={"pod": key})
                verdict = Unplaceable("PlannerError", f"placement engine error: {exc}", True)
        if isinstance(verdict, Unplaceable):
            state.refused = verdict
            self._metrics.count_outcome("unplaceable")
            if (
                self._preemption is not None
                and not verdict.permanent
                and not self._fallback_due(pod)  # handed to kube-scheduler now: evict nobody
            ):
                verdict = self._preemption.unplaceable(pod, claims, verdict, self.stores)
            self._wait(pod, state, verdict, claims)
            return
        if self._held_for_pinned(pod, state, verdict.node):
            return
        self._commit(pod, state, claims, verdict)

    def _commit(self, pod: Obj, state: _PodState, claims: Sequence[Obj], plan: Plan) -> None:
        """Write the plan claim by claim (beside this thread when it can take them); undo what
        was written if a later claim fails."""
        by_key = {key_of(c): c for c in claims}
        todo: list[tuple[ClaimAllocation, Obj]] = []
        for alloc in plan.allocations:
            ckey = f"{alloc.namespace}/{alloc.name}"
            claim = self.stores[Kind.CLAIM].get(ckey) or by_key[ckey]
            if not is_allocated(claim):
                todo.append((alloc, claim))
        hold = self._cfg.hold_gate_until_carved and any(
            plan_waits_for_carve(a.results) for a in plan.allocations
        )
        ungate = has_gate(pod, self._cfg.gate) and not hold
        if self._commit_elsewhere(pod, state, claims, plan, todo=todo, ungate=ungate):
            return
        stored, error = _write_claims(self._writer, todo, self.stores[Kind.CLASS])
        for claim in stored:
            self._store_claim(claim)
        if error is not None:
            self._metrics.count_outcome("write-failed")
            raise error
        self._planner.committed(pod, plan)
        if ungate:
            self._set_pod(key_of(pod), self._writer.remove_gate(pod))
        self._placed(pod, state.first_seen, plan, [a for a, _ in todo])

    def _placed(
        self, pod: Obj, first_seen: float, plan: Plan, written: Sequence[ClaimAllocation]
    ) -> None:
        """Tell the user and the metrics: the plan is written (and the gate gone, unless it
        waits for the carve)."""
        key = key_of(pod)
        for alloc in written:
            devices = ", ".join(f"{r.request}={r.pool}/{r.device}" for r in alloc.results)
            claim = self.stores[Kind.CLAIM].get(f"{alloc.namespace}/{alloc.name}")
            if claim is not None:
                self._recorder.event(
                    claim,
                    Kind.CLAIM,
                    "Normal",
                    "Allocated",
                    f"allocated on node {alloc.node}: {devices}",
                )
        latency = self._clock() - first_seen
        self._metrics.observe_allocation(
            latency, [r.profile for a in written for r in a.results if r.profile]
        )
        self._metrics.count_outcome("allocated")
        summary = "; ".join(
            f"{a.name}: " + ", ".join(r.device for r in a.results) for a in plan.allocations
        )
        message = f"carve placed claims on node {plan.node}: {summary}"
        self._recorder.event(pod, Kind.POD, "Normal", "Placed", message)
        self._condition(pod, True, "Placed", message)
        _log.info(
            "pod %s placed on %s in %.3fs",
            key,
            plan.node,
            latency,
            extra={"pod": key, "node": plan.node},
        )
        self._forget_pod(key)

    # -- commits beside the decision thread -----------------------------------------------------

    def _commit_elsewhere(
        self,
        pod: Obj,
        state: _PodState,
        claims: Sequence[Obj],
        plan: Plan,
        *,
        todo: Sequence[tuple[ClaimAllocation, Obj]],
        ungate: bool,
    ) -> bool:
        """Assume the plan in the store and model and hand its writes to `commit_beside`;
        False (nothing assumed) when there is none or it took nothing."""
        if self._commit_beside is None or not todo:
            return False
        key = key_of(pod)
        classes = dict(self.stores[Kind.CLASS])  # the writes must not see later changes
        writer, finalizer, now = self._writer, self._cfg.finalizer, self._wall()

        def writes() -> None:
            stored, error = _write_claims(writer, todo, classes)
            ungated: Obj | None = None
            allocated = error is None
            if allocated and ungate:
                try:
                    ungated = writer.remove_gate(pod)
                except Exception as exc:
                    error = exc
            result = CommitDone(key, stored, ungated, error, allocated)
            self._events.put(result)

        assumed = {
            key_of(claim): _assumed_copy(claim, alloc, classes, finalizer, now)
            for alloc, claim in todo
        }
        for ckey, copy_ in assumed.items():
            self._assumed[ckey] = self.stores[Kind.CLAIM].get(ckey) or copy_
            self.stores[Kind.CLAIM][ckey] = copy_
            self._planner.observe(Kind.CLAIM, copy_)
            self._claim_changed(ckey)
        self._planner.committed(pod, plan)
        self._committing[key] = _Commit(
            plan, tuple(claims), assumed, state.first_seen, tuple(a for a, _ in todo)
        )
        if self._commit_beside(key, writes):
            return True
        del self._committing[key]
        self._unassume(assumed)
        self._planner.withdrawn(pod)
        return False

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

    def _unassume(self, assumed: Mapping[str, Obj]) -> None:
        """Put back the informer's copy of every claim still held as assumed."""
        store = self.stores[Kind.CLAIM]
        for ckey, copy_ in assumed.items():
            real = self._assumed.pop(ckey, None)
            if store.get(ckey) is copy_ and real is not None:
                store[ckey] = real
                self._planner.observe(Kind.CLAIM, real)
                self._claim_changed(ckey)
                self._wake_all(capacity=True)
            self._dirty_claims.add(ckey)

    def _commit_done(self, result: CommitDone) -> None:
        commit = self._committing.pop(result.pod, None)
        if commit is None:
            return
        self._queue.changed(result.pod)  # the pod is visited again, whatever came of it
        self._unassume(commit.assumed)
        for claim in result.stored:
            self._written_beside(claim)
        pods = self.stores[Kind.POD]
        pod = pods.get(result.pod)
        if pod is None:
            return  # deleted meanwhile: its claims are released as for any pod that went
        if result.ungated is not None and not is_older(result.ungated, pod):
            self._set_pod(result.pod, result.ungated)
            pod = result.ungated
        if result.allocated:
            for claim in result.stored:
                self._lost_cleared.pop(key_of(claim), None)
        else:
            self._planner.withdrawn(pod)
        if result.error is not None:
            if not result.allocated:
                self._metrics.count_outcome("write-failed")
            state = self._pods.setdefault(result.pod, _PodState(first_seen=commit.first_seen))
            self._placement_failed(pod, state, commit.claims, result.error)
            return
        self._placed(pod, commit.first_seen, commit.plan, commit.writing)

    def _wait(
        self, pod: Obj, state: _PodState, why: Unplaceable, claims: Sequence[Obj] = ()
    ) -> None:
        now = self._clock()
        state.attempts += 1
        state.permanent = why.permanent
        state.retry_at = now + self._cfg.retry_interval
        if self._fallback_due(pod) and why.reason != "ClaimsNotReady":
            self._hand_to_scheduler(pod, why)
            return
        self._tell(pod, state, claims, why)

    def _tell(self, pod: Obj, state: _PodState, claims: Sequence[Obj], why: Unplaceable) -> None:
        """Why the pod waits, as an event on the pod and on each of its carve claims and as the
        pod's condition; repeated only when the message changes or `event_interval` passed."""
        key = key_of(pod)
        now = self._clock()
        last = self._event_sent.get(key, {}).get(why.message)
        if (
            why.message == state.last_message
            and last is not None
            and now - last <= self._cfg.event_interval
        ):
            return
        state.last_message = why.message
        self._event_sent.setdefault(key, {})[why.message] = now
        self._recorder.event(pod, Kind.POD, "Warning", why.reason, why.message)
        for claim in claims:
            self._recorder.event(
                claim, Kind.CLAIM, "Warning", why.reason, f"pod {key}: {why.message}"
            )
        self._condition(pod, False, why.reason, why.message)
        _log.info("pod %s waits: %s", key, why.message, extra={"pod": key})

    def _fallback_due(self, pod: Obj) -> bool:
        """Unplaceable for `native_fallback_after` since creation, or since the controller saw
        another gate (a queue's) go: time spent queued in Kueue is not time carve failed to
        place."""
        after = self._cfg.native_fallback_after
        if after is None or not has_gate(pod, self._cfg.gate):
            return False
        start = _parse_time(pod.get("metadata", {}).get("creationTimestamp"))
        state = self._pods.get(key_of(pod))
        if start is not None and state is not None and state.held_until is not None:
            start = max(start, state.held_until)
        return start is not None and (self._wall() - start).total_seconds() >= after

    def _hand_to_scheduler(self, pod: Obj, why: Unplaceable) -> None:
        """Ungate an unplaceable pod so kube-scheduler and Cluster Autoscaler see it."""
        key = key_of(pod)
        self._release_to_scheduler(
            pod,
            "HandedToScheduler",
            f"unplaceable for longer than {self._cfg.native_fallback_after:.0f}s "
            f"({why.message}); gate removed so kube-scheduler can allocate natively",
        )
        self._set_pod(key, self._writer.remove_gate(pod))


_RAW_BYTES_HINT = (
    "kube-apiserver compares a claim's opaque config parameters byte for byte and refuses every "
    "metadata change (even `kubectl label`) to a claim whose parameters were sent as JSON with "
    "whitespace, as the Python client sends them; create the claim or its template from YAML "
    "with kubectl, or from compact JSON"
)


def _write_failure(exc: BaseException) -> Unplaceable:
    """An unexpected error while writing a placement, as a user can read it: the apiserver's
    own status message when there is one (it names the object and the field)."""
    status = getattr(exc, "status", None)
    detail = str(exc)
    body = getattr(exc, "body", None)
    if body:
        try:
            detail = str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            detail = str(body)
    if status == 422 and "spec: Invalid value: null: field is immutable" in detail:
        # Retrying cannot help: the same bytes are refused until the claim is recreated.
        return Unplaceable(
            "ClaimNotWritable",
            f"carve cannot add its finalizer to the claim ({detail}): {_RAW_BYTES_HINT}",
            permanent=True,
        )
    if status:
        detail = f"the API server answered {status}: {detail}"
    return Unplaceable(
        "PlacementWriteFailed",
        f"carve chose a placement but could not record it ({detail}); retrying with backoff",
    )


def _scheduling_message(pod: Obj) -> str:
    """kube-scheduler's last word on the pod (the PodScheduled condition), if any."""
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason") or "")
    return ""


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
    meta = claim.get("metadata", {})
    finalizers = list(meta.get("finalizers") or [])
    if finalizer not in finalizers:
        finalizers.append(finalizer)
    status = {
        **(claim.get("status") or {}),
        "allocation": build_allocation_status(claim, alloc, classes, now),
    }
    return {**claim, "metadata": {**meta, "finalizers": finalizers}, "status": status}


def _run_now(_key: str, write: Callable[[], None]) -> None:
    write()


def _allocation_dropped(old: Obj | None, new: Obj) -> bool:
    return old is not None and is_allocated(old) and not is_allocated(new)
