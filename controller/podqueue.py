"""Which waiting pods a placement pass must look at, so that a pass costs what changed.

A pass used to classify every waiting pod (`pod_work`) and sort them all, on every event. Each
placement brings about sixteen events (its writes, kube-scheduler's binding, the release when
the pod ends), so with a backlog of N pods a placement cost about 16 * N classifications: at
300 waiting pods that was about a quarter of the controller's CPU.

Here each pod's classification is kept until something it depends on changes: the pod itself
or one of the claims it names (the reconciler says so through `changed`). A pass visits only
the pods that are *due*: reclassified, woken (`wake`: capacity came free, a commit ended), or
whose own time came (`wake_at`: a retry, the end of a grace period). A visit that finds a pod
not ready yet is cheap and harmless; a pod never visited again would wait forever, so the
reconciler wakes generously and `Reconciler.resync` marks every pod changed now and then.

Fair across namespaces (issue 41.5): within one priority, pods are served round-robin by
namespace (the oldest of each namespace, then the second oldest of each, ...), not oldest
first across the cluster, so one namespace's backlog of thousands cannot put another
namespace's new pod behind all of it. Priority still comes first, and within a namespace the
order stays oldest first. A pass may stop after a budget of visits (`take_due(limit=)`): the
rest stay due for the next pass, which first applies what arrived meanwhile.

Pure bookkeeping: no I/O, no clock of its own (the caller passes `now`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Generic, TypeVar

W = TypeVar("W")


@dataclass(frozen=True)
class Queued(Generic[W]):
    """A waiting pod's classification, its place in the queue, and whether it counts in the
    queue depth (`carve_pending_pods`)."""

    work: W
    order: tuple[int, str, str]
    counted: bool


class PodQueue(Generic[W]):
    def __init__(self) -> None:
        self._entries: dict[str, Queued[W]] = {}
        self._stale: set[str] = set()  # classify again before the next visit
        self._due: set[str] = set()  # visit in the next pass
        self._timers: list[tuple[float, str]] = []  # (when, key), a heap
        self._timer_at: dict[str, float] = {}  # key -> its earliest live timer
        self._counted = 0

    # -- what changed -------------------------------------------------------------------------

    def changed(self, key: str) -> None:
        """The pod or one of its claims changed (or it may have): classify it again."""
        self._stale.add(key)

    def wake(self, key: str) -> None:
        """Visit the pod in the next pass, with the classification it has."""
        if key in self._entries:
            self._due.add(key)

    def wake_at(self, key: str, when: float) -> None:
        """Visit the pod once `when` has come (unless an earlier wake-up is set already)."""
        at = self._timer_at.get(key)
        if at is not None and at <= when:
            return
        self._timer_at[key] = when
        heapq.heappush(self._timers, (when, key))

    # -- classification -----------------------------------------------------------------------

    def take_stale(self) -> list[str]:
        """Keys to classify again (then `put` or `drop` each)."""
        stale, self._stale = self._stale, set()
        return sorted(stale)

    def put(self, key: str, entry: Queued[W]) -> Queued[W] | None:
        """Hold a fresh classification and make the pod due; returns the one it replaces."""
        old = self._entries.get(key)
        self._counted += entry.counted - (old.counted if old is not None else False)
        self._entries[key] = entry
        self._due.add(key)
        return old

    def drop(self, key: str) -> Queued[W] | None:
        """The pod needs nothing from the controller (ended, bound, gone)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._counted -= old.counted
        self._due.discard(key)
        self._timer_at.pop(key, None)
        return old

    # -- a pass -------------------------------------------------------------------------------

    def take_due(self, now: float, limit: int | None = None) -> list[tuple[str, Queued[W]]]:
        """The pods to visit now, in queue order (at most `limit` of them); they are no longer
        due (a visit that leaves one waiting sets its next wake-up, or leaves it to the next
        change); those past the limit stay due."""
        while self._timers and self._timers[0][0] <= now:
            when, key = heapq.heappop(self._timers)
            if self._timer_at.get(key) == when:
                del self._timer_at[key]
                self.wake(key)
        due, self._due = self._due, set()
        out = _fair([(key, self._entries[key]) for key in due if key in self._entries])
        if limit is not None and len(out) > limit:
            self._due.update(key for key, _ in out[limit:])
            out = out[:limit]
        return out

    @property
    def has_due(self) -> bool:
        """Whether pods are due already (a pass stopped at its limit): the next pass should
        not wait for a message first."""
        return bool(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ordered(self) -> list[tuple[str, Queued[W]]]:
        """Every waiting pod in queue order."""
        return _fair(list(self._entries.items()))

    @property
    def depth(self) -> int:
        """How many waiting pods count in the queue depth."""
        return self._counted


def _fair(entries: list[tuple[str, Queued[W]]]) -> list[tuple[str, Queued[W]]]:
    """Queue order: by priority, then round-robin across namespaces (a pod's rank among the
    pods of its namespace and priority), then the pod's own order (age, then key)."""
    entries.sort(key=lambda ke: ke[1].order)
    ranks: dict[tuple[int, str], int] = {}
    ranked = []
    for key, queued in entries:
        group = (queued.order[0], key.partition("/")[0])
        rank = ranks.get(group, 0)
        ranks[group] = rank + 1
        ranked.append(((queued.order[0], rank, queued.order), key, queued))
    ranked.sort(key=lambda r: r[0])
    return [(key, queued) for _, key, queued in ranked]
