"""Carve before bind, acted on: keep a placed pod's gate while its node carves, and place it
again when the carve failed (`carvewait` says which; its docstring says why).

A failed carve clears the claims' allocations (the pod is still gated, so kube-scheduler never
saw them) once the node has torn the failed carve down (its finalizer is gone), and the pod is
placed again. After `max_replans` failed carves the pod keeps what it has and its user is told,
rather than loop on a claim that no GPU can carve.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

from controller.config import ReconcilerConfig
from controller.memory import PodMemory, Wait
from controller.nodehealth.carvewait import CarveState, carve_verdict
from controller.objects import Kind, Unplaceable, key_of, node_finalizers
from controller.outcomes import Outcomes
from controller.seams import ClaimWriter, Recorder
from process.kube import Obj


class CarveHold:
    """Decides, for a gated pod whose claims are allocated, whether the gate may go yet."""

    def __init__(
        self,
        *,
        memory: PodMemory,
        writer: ClaimWriter,
        recorder: Recorder,
        outcomes: Outcomes,
        config: ReconcilerConfig,
        written: Callable[[Obj], None],
        wall_clock: Callable[[], dt.datetime],
    ) -> None:
        """`written(claim)` stores a claim this controller just wrote."""
        self._memory = memory
        self._writer = writer
        self._recorder = recorder
        self._outcomes = outcomes
        self._cfg = config
        self._written = written
        self._wall = wall_clock

    def holds(self, pod: Obj, wait: Wait, claims: Sequence[Obj], now: float) -> bool:
        """Keep the gate while the node carves; on a failed carve clear and place again.
        False: ungate now (nothing to wait for, carved, or the wait is over)."""
        if not self._cfg.hold_gate_until_carved:
            return False
        verdict = carve_verdict(claims, self._cfg.driver, self._wall(), self._cfg.carve_wait)
        key = key_of(pod)
        if verdict.state is CarveState.PENDING:
            wait.retry_at = now + min(1.0, verdict.wait_left)  # claim events wake it sooner
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
        record = self._memory.record(key)
        if verdict.state is not CarveState.FAILED:
            record.carve_failures = 0
            return False
        why = "; ".join(f"{f.device}: {f.message}" for f in verdict.failures)
        done = record.carve_failures
        if done >= self._cfg.max_replans:
            # Placed again max_replans times and every carve failed: keep what we have and
            # say so, rather than loop on a claim that no GPU can carve.
            wait.retry_at = now + self._cfg.retry_interval
            refused = Unplaceable("CarveFailed", f"carve failed {done + 1} times: {why}")
            self._outcomes.tell(pod, wait, claims, refused)
            return True
        failed = {f.claim for f in verdict.failures}
        clearable = [
            c for c in claims if key_of(c) in failed and not node_finalizers(c, self._cfg.contract)
        ]
        if not clearable:
            wait.retry_at = now + 1.0  # the node is still tearing the failed carve down
            return True
        record.carve_failures = done + 1
        for claim in clearable:
            self._written(self._writer.clear_allocation(claim))
            self._recorder.event(
                claim, Kind.CLAIM, "Warning", "CarveFailed", f"{why}; placing again"
            )
        message = f"the node could not carve: {why}; placing again"
        self._recorder.event(pod, Kind.POD, "Warning", "CarveFailed", message)
        wait.retry_at = now  # unallocated now: place it again
        return True
