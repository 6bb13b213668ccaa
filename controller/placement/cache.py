"""The one memo table the engine uses for everything it remembers between decisions."""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_MAX_ENTRIES = 200_000


class BoundedCache(Generic[K, V]):
    """A dictionary that empties itself when full.

    Clear-when-full rather than LRU, because every key the engine uses carries all the inputs
    of its answer (GPU model and state, request shape, class selectors), so an entry is never
    stale and forgetting everything is always safe; the working set (distinct GPU states and
    request shapes) stays far below the limit, so a clear is rare, and a hit costs one plain
    dictionary look-up instead of LRU bookkeeping on every hit of the hot path.

    ``None`` is not a storable value: :meth:`get` answers None for "not remembered".
    """

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` and return it (so a miss reads ``return cache.put(k, f())``)."""
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key] = value
        return value

    def __len__(self) -> int:
        return len(self._entries)
