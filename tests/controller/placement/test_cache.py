from __future__ import annotations

from controller.placement.cache import BoundedCache


def test_remembers_until_full_then_starts_over() -> None:
    cache: BoundedCache[str, int] = BoundedCache(max_entries=2)
    assert cache.put("a", 1) == 1
    cache.put("b", 0)  # falsy values are values
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, 0, None)
    cache.put("c", 3)  # full: everything is forgotten, then c is remembered
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, None, 3)
    assert len(cache) == 1
