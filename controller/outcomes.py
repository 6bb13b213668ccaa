"""How a pod's visit ends, as its user and the metrics see it: placed, still waiting (and why),
failed to write, or handed over to kube-scheduler.

Users read pods and claims, not the controller's log. A wait, a refusal or a failed write is
told as an event on the pod and on its carve claims and as the pod's `<driver>/Placed`
condition; a wait is told again only when its message changes or `event_interval` passed, so a
pod that waits an hour yields one event series, not one event per pass. A placement is told as
kube-scheduler tells a binding: one `Placed` event on the pod, nothing on the claims (their
allocation says it), and the condition only where a wait had set it (to turn it True), since
every request a placement sends is one the controller's single process must make (issue 29).
All of these are best effort (`defer`: a failed write is logged and never blocks a decision).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence

from controller.autoscaling import hint_message, hint_of, movable_value_error
from controller.config import ReconcilerConfig
from controller.memory import PodMemory, Wait
from controller.objects import (
    ClaimAllocation,
    Kind,
    Plan,
    Unplaceable,
    handed_to_scheduler,
    has_condition,
    has_finalizer,
    has_gate,
    is_allocated,
    is_carve_claim,
    key_of,
    pod_claim_names,
)
from controller.seams import ClaimWriter, Metrics, Recorder
from controller.status import ObjectGoneError, WriteSkippedError
from controller.store import ClusterStore
from driver.apiviews import ObjectView
from process.kube import Obj
from process.kube.errors import message_of, status_of

_log = logging.getLogger(__name__)

Defer = Callable[[str, Callable[[], None]], None]
"""`(key, write)`: run a best-effort write later, in order per key (`WritePool.submit`)."""


class Outcomes:
    """Ends a visit: tells the user and the metrics, and sets when to look at the pod again."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        memory: PodMemory,
        writer: ClaimWriter,
        recorder: Recorder,
        metrics: Metrics,
        config: ReconcilerConfig,
        written: Callable[[Obj], None],
        defer: Defer,
        clock: Callable[[], float],
        wall_clock: Callable[[], dt.datetime],
    ) -> None:
        """`written(claim)` stores a claim this controller just wrote."""
        self._store = store
        self._memory = memory
        self._writer = writer
        self._recorder = recorder
        self._metrics = metrics
        self._cfg = config
        self._written = written
        self._defer = defer
        self._clock = clock
        self._wall = wall_clock

    def condition(self, pod: Obj, status: bool, reason: str, message: str) -> None:
        """Best effort, like events: a failed condition write never blocks a decision."""

        def write() -> None:
            try:
                self._writer.set_pod_condition(pod, status, reason, message)
            except Exception as exc:
                _log.info("pod %s: could not set condition: %s", key_of(pod), exc)

        self._defer(key_of(pod), write)

    def hint(self, pod: Obj, message: str | None) -> None:
        """Set carve's Unschedulable hint with `message`, or reset it (None), on a pod that
        still has carve's gate (`controller.autoscaling`); only when that changes what the pod
        shows, and best effort, written beside the decision like a condition."""
        gate = self._cfg.gate
        if not has_gate(pod, gate):
            return  # kube-scheduler owns PodScheduled
        key = key_of(pod)
        record = self._memory.record(key)
        have = record.hint if record.hint_sent else hint_of(pod, gate)
        want = None if message is None else message[:32768]
        if have == want:
            return
        record.hint, record.hint_sent = want, True

        def write() -> None:
            try:
                if want is None:
                    self._writer.reset_unschedulable(pod)
                else:
                    self._writer.set_unschedulable(pod, want)
            except Exception as exc:
                _log.info("pod %s: could not write the autoscaler hint: %s", key, exc)

        self._defer(key, write)

    # -- placed ----------------------------------------------------------------------------

    def placed(
        self, pod: Obj, first_seen: float, plan: Plan, written: Sequence[ClaimAllocation]
    ) -> None:
        """Tell the user and the metrics: the plan is written (and the gate gone, unless it
        waits for the carve)."""
        key = key_of(pod)
        latency = self._clock() - first_seen
        self._metrics.observe_allocation(
            latency, [r.profile for a in written for r in a.results if r.profile]
        )
        self._metrics.count_outcome("allocated")
        summary = "; ".join(
            f"{a.name}: " + ", ".join(r.device for r in a.results) for a in plan.allocations
        )
        message = f"carve placed claims on node {plan.node}: {summary}"
        self.tell_placed(pod, message)
        _log.info(
            "pod %s placed on %s in %.3fs",
            key,
            plan.node,
            latency,
            extra={"pod": key, "node": plan.node},
        )
        self._memory.settle(key)

    def tell_placed(self, pod: Obj, message: str) -> None:
        """One `Placed` event; the condition only if a wait set it before (see the module)."""
        self._recorder.event(pod, Kind.POD, "Normal", "Placed", message)
        bad_movable = movable_value_error(pod, self._cfg.contract)
        if bad_movable is not None:
            self._recorder.event(pod, Kind.POD, "Warning", "MovableAnnotationIgnored", bad_movable)
        wait = self._memory.wait_of(key_of(pod))
        told = wait is not None and bool(wait.last_message)
        if told or has_condition(pod, self._cfg.contract.placed_condition):
            self.condition(pod, True, "Placed", message)

    # -- waiting ---------------------------------------------------------------------------

    def waits(
        self,
        pod: Obj,
        wait: Wait,
        why: Unplaceable,
        claims: Sequence[Obj] = (),
        *,
        capacity: bool = False,
    ) -> None:
        """The pod cannot be placed now: look again after `retry_interval` (or when something
        changes), unless it is due for kube-scheduler; say why. `capacity`: for lack of
        capacity that no preemption and no release in flight will end, so Cluster Autoscaler
        is told (`controller.autoscaling`); otherwise a hint is reset."""
        now = self._clock()
        wait.attempts += 1
        wait.permanent = why.permanent
        wait.retry_at = now + self._cfg.retry_interval
        if self.fallback_due(pod) and why.reason != "ClaimsNotReady":
            self._hand_to_scheduler(pod, why)
            return
        self.hint(pod, hint_message(claims, why) if capacity else None)
        self.tell(pod, wait, claims, why)

    def held(self, pod: Obj, wait: Wait, reason: str, message: str) -> None:
        """Held by another scheduling gate (a queue's) for as long as it likes: said once, not
        every pass."""
        self.hint(pod, None)  # a queue's wait is no lack of capacity
        if wait.last_message != message:
            wait.last_message = message
            self._recorder.event(pod, Kind.POD, "Normal", reason, message)
            self.condition(pod, False, reason, message)

    def tell(self, pod: Obj, wait: Wait, claims: Sequence[Obj], why: Unplaceable) -> None:
        """Why the pod waits, as an event on the pod and on each of its carve claims and as the
        pod's condition; repeated only when the message changes or `event_interval` passed."""
        key = key_of(pod)
        now = self._clock()
        last = wait.told.get(why.message)
        if (
            why.message == wait.last_message
            and last is not None
            and now - last <= self._cfg.event_interval
        ):
            return
        wait.last_message = why.message
        wait.told[why.message] = now
        self._recorder.event(pod, Kind.POD, "Warning", why.reason, why.message)
        for claim in claims:
            self._recorder.event(
                claim, Kind.CLAIM, "Warning", why.reason, f"pod {key}: {why.message}"
            )
        self.condition(pod, False, why.reason, why.message)
        _log.info("pod %s waits: %s", key, why.message, extra={"pod": key})

    def failed(self, pod: Obj, wait: Wait, claims: Sequence[Obj], exc: Exception) -> None:
        """A placement's writes failed: look again soon (a skipped write) or with backoff."""
        key, now = key_of(pod), self._clock()
        if isinstance(exc, WriteSkippedError | ObjectGoneError):
            _log.info("pod %s: %s; will look again", key, exc, extra={"pod": key})
            wait.retry_at = now + 1.0
            return
        _log.error("pod %s: placement failed; will retry", key, exc_info=exc, extra={"pod": key})
        wait.attempts += 1
        wait.retry_at = now + min(30.0, 0.5 * 2**wait.attempts)
        # Not only a log line: the user reads pods and claims, not the controller log.
        why = _write_failure(exc)
        wait.permanent = why.permanent
        self.hint(pod, None)  # carve found a placement: capacity is not what the pod lacks
        self.tell(pod, wait, claims, why)

    # -- handed to kube-scheduler ----------------------------------------------------------

    def fallback_due(self, pod: Obj) -> bool:
        """Unplaceable for `native_fallback_after` since creation, or since the controller saw
        another gate (a queue's) go: time spent queued in Kueue is not time carve failed to
        place."""
        after = self._cfg.native_fallback_after
        if after is None or not has_gate(pod, self._cfg.gate):
            return False
        start = _parse_time(ObjectView(pod).creation_timestamp)
        wait = self._memory.wait_of(key_of(pod))
        if start is not None and wait is not None and wait.held_until is not None:
            start = max(start, wait.held_until)
        return start is not None and (self._wall() - start).total_seconds() >= after

    def _hand_to_scheduler(self, pod: Obj, why: Unplaceable) -> None:
        """Ungate an unplaceable pod so kube-scheduler and Cluster Autoscaler see it."""
        key = key_of(pod)
        self.release_to_scheduler(
            pod,
            "HandedToScheduler",
            f"unplaceable for longer than {self._cfg.native_fallback_after:.0f}s "
            f"({why.message}); gate removed so kube-scheduler can allocate natively",
        )
        self._store.put_pod(key, self._writer.remove_gate(pod, protect=True))

    def release_to_scheduler(self, pod: Obj, reason: str, message: str) -> None:
        """Hand the pod's unallocated carve claims to kube-scheduler: our finalizer off, the
        hand-over mark on (only with it may kube-scheduler allocate them)."""
        ns = ObjectView(pod).namespace
        for name in pod_claim_names(pod)[0]:
            claim = self._store.claims.get(f"{ns}/{name}")
            if (
                claim is not None
                and not is_allocated(claim)
                and is_carve_claim(claim, self._cfg.classes)
                and (
                    has_finalizer(claim, self._cfg.finalizer)
                    or not handed_to_scheduler(claim, self._cfg.contract)
                )
            ):
                self._written(self._writer.hand_to_scheduler(claim))
        self._memory.settle(key_of(pod))
        self._metrics.count_outcome("native-fallback")
        self._recorder.event(pod, Kind.POD, "Warning", reason, message)


_RAW_BYTES_HINT = (
    "kube-apiserver compares a claim's opaque config parameters byte for byte and refuses every "
    "metadata change (even `kubectl label`) to a claim whose parameters were sent as JSON with "
    "whitespace, as the Python client sends them; create the claim or its template from YAML "
    "with kubectl, or from compact JSON"
)


def _write_failure(exc: BaseException) -> Unplaceable:
    """An unexpected error while writing a placement, as a user can read it: the apiserver's
    own status message when there is one (it names the object and the field)."""
    status = status_of(exc)
    detail = message_of(exc)
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


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
