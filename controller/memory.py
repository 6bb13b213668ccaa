"""What the controller remembers of each pod it may still have to place: one record per pod.

A pod is remembered while it is a *candidate*: it may need the controller (it has not ended,
is not bound, is not being deleted, and names a claim or carries carve's gate; `work.
may_need_work`). Each of those states is final, so once a pod stops being a candidate it is
forgotten, all of it, by one `forget`: its queue entry, its wait, and the rounds counted across
waits (kube-scheduler's clearings, failed carves).

A *wait* is one stretch of waiting for a placement: when it began, when to look again, what
the user was told. It ends (`end_wait`) when the pod is placed, ungated or handed over, or needs
nothing for now; counting starts afresh should the pod need the controller again.

The queue (`controller.podqueue`) holds each candidate's classification and which the next
pass visits; the wake-ups here say which pods to look at again, and when.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from controller.objects import Unplaceable
from controller.podqueue import PodQueue
from controller.work import PodWork, may_need_work
from process.kube import Obj


@dataclass
class Wait:
    """One stretch of waiting for a placement (mutable: the decision thread updates it)."""

    first_seen: float
    last_message: str = ""
    attempts: int = 0
    retry_at: float = 0.0
    permanent: bool = False
    # When the controller saw another scheduling gate go (or last saw one hold the pod).
    held_until: dt.datetime | None = None
    # The planner's last refusal, before preemption added to it (`Planner.plan`'s `told`).
    refused: Unplaceable | None = None
    # Message -> when it was last told (events and condition), so a wait is told once per
    # `event_interval`, not once per pass.
    told: dict[str, float] = field(default_factory=dict)


@dataclass
class PodRecord:
    """Everything remembered of one pod."""

    candidate: bool = False
    wait: Wait | None = None
    # Ungated pods whose allocation kube-scheduler cleared: how often, and when to retry.
    replans: int = 0
    replan_after: float = 0.0
    carve_failures: int = 0  # failed carves while gated
    # carve's Unschedulable hint (`controller.autoscaling`) as last sent: its message, None
    # for reset. Until `hint_sent`, the pod's own copy says what it shows.
    hint: str | None = None
    hint_sent: bool = False


class PodMemory:
    """The records of the pods the controller may still have to place, and their queue."""

    def __init__(self, gate: str) -> None:
        self._gate = gate
        self._records: dict[str, PodRecord] = {}
        self.queue: PodQueue[PodWork] = PodQueue()

    # -- which pods are remembered -------------------------------------------------------------

    def index(self, key: str, pod: Obj | None) -> None:
        """A pod as now stored (None: deleted): remember it while it is a candidate, else
        forget it."""
        if pod is not None and may_need_work(pod, self._gate):
            self.record(key).candidate = True
        else:
            self.forget(key)

    def forget(self, key: str) -> None:
        """The pod will never need the controller again: drop everything about it."""
        self._records.pop(key, None)
        self.queue.drop(key)

    def is_candidate(self, key: str) -> bool:
        record = self._records.get(key)
        return record is not None and record.candidate

    def candidates(self) -> Iterator[str]:
        return (key for key, r in self._records.items() if r.candidate)

    def record(self, key: str) -> PodRecord:
        """The pod's record, made if it has none."""
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = PodRecord()
        return record

    # -- waits ---------------------------------------------------------------------------------

    def wait_of(self, key: str) -> Wait | None:
        record = self._records.get(key)
        return None if record is None else record.wait

    def waiting(self, key: str, now: float) -> Wait:
        """The pod's wait, begun at `now` if it has none."""
        record = self.record(key)
        if record.wait is None:
            record.wait = Wait(first_seen=now)
        return record.wait

    def end_wait(self, key: str) -> None:
        record = self._records.get(key)
        if record is not None:
            record.wait = None

    def settle(self, key: str) -> None:
        """The pod needs nothing more from us for now: end its wait and classify it afresh
        should it still need something (its next change says what)."""
        self.end_wait(key)
        self.queue.changed(key)

    def _waits(self) -> Iterator[tuple[str, Wait]]:
        for key, record in self._records.items():
            if record.wait is not None:
                yield key, record.wait

    # -- wake-ups ------------------------------------------------------------------------------

    def pod_changed(self, key: str) -> None:
        """The pod itself changed: whatever held it back may be gone, look again now."""
        wait = self.wait_of(key)
        if wait is not None:
            wait.retry_at = 0.0
            wait.permanent = False

    def claim_changed(self, users: Iterable[str]) -> None:
        """A claim that these pods name changed in the store: classify them again."""
        for key in users:
            self.queue.changed(key)

    def wake_users(self, users: Iterable[str]) -> None:
        """A claim these pods name changed: classify them again and retry them now."""
        for key in users:
            self.queue.changed(key)
            self.pod_changed(key)

    def look_again_at_all(self) -> None:
        """Classify every candidate again and retry every wait now (the periodic resync)."""
        for _, wait in self._waits():
            wait.retry_at = 0.0
        for record in self._records.values():
            record.hint_sent = False  # a best-effort write may have failed: trust the pods
        for key in self.candidates():  # every pod the queue holds is a candidate
            self.queue.changed(key)

    def wake_all(self, *, capacity: bool = False, classes: bool = False) -> None:
        """Capacity changes retry pods that lacked room; class changes also retry bad claims."""
        for key, wait in self._waits():
            if (capacity and not wait.permanent) or classes:
                wait.retry_at = 0.0
                wait.permanent = False
                self.queue.wake(key)
