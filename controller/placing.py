"""Placing one pod: ask the engine where its claims go, then commit, wait or preempt.

The engine behind the `Planner` seam (`controller.placement` through `controller.planner`)
chooses; this module acts on its answer for the three kinds of pod the reconciler hands it:

- a gated pod whose carve claims are unallocated (`place`): a `Plan` is committed
  (`controller.commit`), an `Unplaceable` is told to the user after preemption had its say;
- a gated pod asking through extended resources (`place_extended`): carve's best fit picks the
  node, the pod is pinned there and ungated, and kube-scheduler allocates its claim
  (`controller.extended_resources` says why carve cannot write that allocation itself);
- an ungated pod whose allocation kube-scheduler cleared (`replan`): placed again, with a
  growing wait, and left to kube-scheduler after `max_replans` rounds; an ungated pod whose
  claims carve never allocated (it escaped the gate) is placed like a gated one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from controller.autoscaling import lacks_capacity
from controller.commit import Committer
from controller.config import ReconcilerConfig
from controller.extended_resources import (
    ExtendedResourceError,
    PinnedPods,
    extended_stand_in,
    in_users_words,
)
from controller.memory import PodMemory, Wait
from controller.nodehealth.lost import LostNodes
from controller.objects import (
    Kind,
    Plan,
    Unplaceable,
    claim_class_names,
    has_gate,
    key_of,
)
from controller.outcomes import Outcomes
from controller.seams import ClaimWriter, Metrics, Planner, PreemptionHook, Recorder
from controller.store import ClusterStore
from driver.apiviews import ObjectView, PodView
from process.kube import Obj

_log = logging.getLogger(__name__)


class Placer:
    """Acts on the engine's answer for one pod (the module docstring lists the three kinds)."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        memory: PodMemory,
        planner: Planner,
        committer: Committer,
        outcomes: Outcomes,
        lost: LostNodes,
        writer: ClaimWriter,
        recorder: Recorder,
        metrics: Metrics,
        config: ReconcilerConfig,
        preemption: PreemptionHook | None,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._memory = memory
        self._planner = planner
        self._committer = committer
        self._outcomes = outcomes
        self._lost = lost
        self._writer = writer
        self._recorder = recorder
        self._metrics = metrics
        self._cfg = config
        self._preemption = preemption
        self._clock = clock
        self._pinned = PinnedPods()

    def place(self, pod: Obj, wait: Wait, claims: Sequence[Obj]) -> None:
        """Decide where the pod's claims go and commit, or tell why they go nowhere now."""
        key = key_of(pod)
        classes = self._store.objects[Kind.CLASS]
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
                verdict = self._decide(pod, claims, classes, told=wait.refused)
            except Exception as exc:
                _log.exception("planner failed for pod %s", key, extra={"pod": key})
                verdict = Unplaceable("PlannerError", f"placement engine error: {exc}", True)
        if isinstance(verdict, Unplaceable):
            wait.refused = verdict
            self._metrics.count_outcome("unplaceable")
            if (
                self._preemption is not None
                and not verdict.permanent
                and not self._outcomes.fallback_due(pod)  # handed over now: evict nobody
            ):
                verdict = self._preemption.unplaceable(pod, claims, verdict, self._store.objects)
            capacity = self._lacks_capacity(pod, claims, verdict)
            self._outcomes.waits(pod, wait, verdict, claims, capacity=capacity)
            return
        if self._held_for_pinned(pod, wait, verdict.node):
            return
        self._committer.commit(pod, wait, claims, verdict)

    def _lacks_capacity(self, pod: Obj, claims: Sequence[Obj], why: Unplaceable) -> bool:
        """Whether to tell Cluster Autoscaler (`controller.autoscaling`): `why` is a lack of
        capacity (preemption had its say: `Preempting` is none), and no placement being
        released would fit the pod."""
        if not lacks_capacity(why):
            return False
        released = self._store.releasing
        return not (released and self._planner.fits_after_release(pod, claims, released))

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

    def place_extended(
        self, pod: Obj, wait: Wait, claims: Sequence[Obj], names: Mapping[str, str]
    ) -> None:
        """A pod asking through extended resources: carve's best fit picks the node, the pod is
        pinned there and ungated, and kube-scheduler allocates its claim on that node."""
        try:
            stand_in = extended_stand_in(pod, claims, names)
        except ExtendedResourceError as exc:
            why = Unplaceable(exc.reason, str(exc), permanent=True)
            self._outcomes.waits(pod, wait, why, claims)
            return
        verdict = self._decide(pod, [stand_in], self._store.objects[Kind.CLASS])
        if isinstance(verdict, Unplaceable):
            self._metrics.count_outcome("unplaceable")
            message = in_users_words(verdict.message, pod, names)
            capacity = self._lacks_capacity(pod, [stand_in], verdict)
            self._outcomes.waits(pod, wait, replace(verdict, message=message), capacity=capacity)
            return
        if self._held_for_pinned(pod, wait, verdict.node):
            return
        key = key_of(pod)
        self._store.put_pod(key, self._writer.pin_and_ungate(pod, verdict.node))
        self._pinned.pin(key, ObjectView(pod).uid, verdict.node, self._clock())
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
        self._outcomes.tell_placed(pod, message)
        _log.info("pod %s pinned to %s", key, verdict.node, extra={"pod": key})
        self._memory.settle(key)

    def _held_for_pinned(self, pod: Obj, wait: Wait, node: str) -> bool:
        """Whether a decision on `node` must wait for a pod pinned there (`PinnedPods`)."""
        key, now = key_of(pod), self._clock()
        blocker = self._pinned.blocker(node, key, now, self._store.pods, self._store.claims)
        if blocker is None:
            return False
        _log.info(
            "pod %s: node %s waits for kube-scheduler's allocation of pinned pod %s",
            key,
            node,
            blocker,
            extra={"pod": key, "node": node},
        )
        wait.retry_at = now + 0.5
        return True

    def replan(self, pod: Obj, wait: Wait, claims: Sequence[Obj], now: float) -> None:
        """Allocate again after kube-scheduler's PostFilter cleared an allocation of ours.

        The scheduler does that when the pod fits no node, including the one carve chose (for
        instance because of a resource carve does not model, or a node change in between).
        Re-planning at once could loop forever, so each round waits longer, and after
        `max_replans` rounds the pod is left to kube-scheduler's own allocator.
        """
        if not any(self._store.was_allocated(c) for c in claims):
            self._place_escaped(pod, wait, claims)
            return
        lost = self._lost.cleared_by_loss(claims)
        if lost:
            # Not kube-scheduler's doing: the node went away before the pod was bound there.
            self._recorder.event(
                pod,
                Kind.POD,
                "Warning",
                "NodeLost",
                f"{lost[0].describe()} before this pod was bound there; placing its claims again",
            )
            self.place(pod, wait, claims)
            return
        record = self._memory.record(key_of(pod))
        rounds, not_before = record.replans, record.replan_after
        if now < not_before:
            wait.retry_at = not_before
            return
        if rounds >= self._cfg.max_replans:
            record.replans, record.replan_after = 0, 0.0
            self._outcomes.release_to_scheduler(
                pod,
                "SchedulerRejectedPlacement",
                f"kube-scheduler cleared carve's allocation {rounds} times "
                f"({_scheduling_message(pod) or 'the pod fits no node'}); "
                "leaving the allocation to kube-scheduler",
            )
            return
        record.replans, record.replan_after = rounds + 1, now + min(60.0, 2.0 ** (rounds + 1))
        self._recorder.event(
            pod,
            Kind.POD,
            "Warning",
            "AllocationCleared",
            "kube-scheduler cleared the allocation of this pod's claims "
            f"({_scheduling_message(pod) or 'no reason given'}); placing again",
        )
        self.place(pod, wait, claims)

    def _place_escaped(self, pod: Obj, wait: Wait, claims: Sequence[Obj]) -> None:
        """A pod that reached kube-scheduler without carve's gate, its carve claims never
        allocated: a template the gate policy had not seen yet (one `kubectl apply` of both),
        or a namespace outside the policy's selector. Only carve-controller may allocate them
        (carve-sole-allocator), so carve places it as it would a gated pod; kube-scheduler
        binds it once the allocation is written."""
        if wait.attempts == 0:
            key = key_of(pod)
            _log.info("pod %s has carve claims but not carve's gate", key, extra={"pod": key})
            self._recorder.event(
                pod,
                Kind.POD,
                "Normal",
                "PlacingUngated",
                "this pod reached kube-scheduler without carve's scheduling gate; carve "
                "allocates its claims (kube-scheduler may not allocate carve's claims)",
            )
        self.place(pod, wait, claims)

    def ungate(self, pod: Obj, claims: Sequence[Obj]) -> None:
        """Every carve claim of the pod is allocated (or it has none): remove the gate."""
        key = key_of(pod)
        if has_gate(pod, self._cfg.gate):
            self._store.put_pod(key, self._writer.remove_gate(pod, protect=bool(claims)))
        self._memory.settle(key)
        if claims:
            _log.info("pod %s: claims already allocated; gate removed", key, extra={"pod": key})
        else:
            _log.info("pod %s: no carve claims; gate removed", key, extra={"pod": key})


def _scheduling_message(pod: Obj) -> str:
    """kube-scheduler's last word on the pod (the PodScheduled condition), if any."""
    for cond in PodView(pod).conditions:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason") or "")
    return ""
