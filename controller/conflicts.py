"""Allocations that contradict each other are never silent (invariant 1's alarm).

The model refuses to build on a GPU whose holds contradict each other (two claims allocated one
device, a GPU allocated whole and as slices, slices that overlap): carve places nothing more on
it, and at least one of the pods involved cannot start (the node refuses to carve over a live
instance). carve never allocates so itself; such claims come from another allocator writing
`status.allocation` of claims that select carve's devices (kube-scheduler for a class of its
own, another controller, a hand edit). Whatever the cause, the operator must hear of it: each
conflict is a `Warning` event `AllocationConflict` on every claim involved (repeated every
`event_interval` while it lasts, since events expire), a log line when it appears and when it
ends, and the gauge `carve_allocation_conflicts`. The way out is in
docs/guide/troubleshooting.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from controller.objects import Kind, Problem
from controller.seams import Metrics, Recorder
from controller.store import ClusterStore

_log = logging.getLogger(__name__)

WAY_OUT = (
    "carve places nothing on that GPU until only one claim holds it: delete the pod (or the "
    "claim) that should not have it, normally the one that is not running; see "
    "docs/guide/troubleshooting.md, AllocationConflict"
)


class ConflictReporter:
    """Tells the claims, the log and the metrics about the model's conflicts as they change."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        recorder: Recorder,
        metrics: Metrics,
        clock: Callable[[], float],
        interval: float,
    ) -> None:
        self._store = store
        self._recorder = recorder
        self._metrics = metrics
        self._clock = clock
        self._interval = interval
        self._told: dict[str, tuple[Problem, float]] = {}  # subject -> problem, when told

    def report(self, problems: Mapping[str, Problem]) -> None:
        """Call once per step with the model's current conflicts (cheap when none changed)."""
        if not problems and not self._told:
            return
        now = self._clock()
        for subject in [s for s in self._told if s not in problems]:
            problem, _ = self._told.pop(subject)
            _log.info("allocation conflict resolved: %s", problem.message)
        for subject, problem in problems.items():
            told = self._told.get(subject)
            if told is not None and told[0] == problem and now - told[1] < self._interval:
                continue
            if told is None or told[0] != problem:
                _log.warning(
                    "allocation conflict: %s; %s",
                    problem.message,
                    WAY_OUT,
                    extra={"claim": ", ".join(problem.claims)},
                )
            self._tell(problem)
            self._told[subject] = (problem, now)
        self._metrics.set_conflicts(len(problems))

    def _tell(self, problem: Problem) -> None:
        message = f"{problem.message}; {WAY_OUT}"
        for key in problem.claims:
            claim = self._store.claims.get(key)
            if claim is not None:
                self._recorder.event(claim, Kind.CLAIM, "Warning", "AllocationConflict", message)
