"""When to tell an operator again about a fault that lasts: a Warning on a Node is repeated
once per interval while the fault holds, at once when its detail changes, and forgotten when
it ends, so a lasting fault stays in `kubectl describe node` without an Event per step."""

from __future__ import annotations

from collections.abc import Container, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Reminders(Generic[K, V]):
    """What was last told per key (a node, a GPU on a node), and when."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._told: dict[K, tuple[V, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._told)

    def ended(self, current: Container[K]) -> list[tuple[K, V]]:
        """Forget the keys no longer in ``current``; returns them with what they were told."""
        gone = [(k, told[0]) for k, told in self._told.items() if k not in current]
        for k, _ in gone:
            del self._told[k]
        return gone

    def last(self, key: K) -> V | None:
        told = self._told.get(key)
        return None if told is None else told[0]

    def due(self, key: K, value: V, now: float) -> bool:
        """Whether ``key`` is to be told ``value`` now (and, if so, it is counted as told)."""
        told = self._told.get(key)
        if told is not None and told[0] == value and now - told[1] < self._interval:
            return False
        self._told[key] = (value, now)
        return True
