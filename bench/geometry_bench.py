"""Micro-benchmark of driver.geometry: fit checks and `admits` look-ups per second.

Run: python -m bench.geometry_bench [--seconds S]

For each model it enumerates every reachable MIG state (the premise of the per-state caches is
that there are few), then measures
  * fit checks on warm caches (the placement engine's steady state),
  * `admits` look-ups cold (a fresh Geometry, each state computed once) and cached,
  * `place` transitions on warm caches.
Figures are printed, not asserted: speed is checked by reading them, not by a timed test.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from driver.catalog import GpuModel, gpu_model
from driver.geometry import EMPTY_STATE, Geometry, GpuState

MODELS = ("A30-24GB", "A100-SXM4-40GB", "H100-SXM5-80GB", "B200-180GB", "RTX-PRO-6000-Blackwell")


def reachable_states(geometry: Geometry) -> list[GpuState]:
    """Every state reachable from an empty GPU by creating instances."""
    seen = {EMPTY_STATE}
    frontier = [EMPTY_STATE]
    while frontier:
        nxt = []
        for state in frontier:
            for pid in geometry.profile_ids:
                for start in geometry.feasible_starts(state, pid):
                    child = geometry.place(state, pid, start)
                    if child not in seen:
                        seen.add(child)
                        nxt.append(child)
        frontier = nxt
    return sorted(seen, key=lambda s: s.instances)


def _rate(fn: Callable[[], int], seconds: float) -> float:
    """Operations per second of `fn` (which returns how many it did), run for ~`seconds`."""
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        done += fn()
    return done / elapsed


def bench_model(model: GpuModel, seconds: float, rng: random.Random) -> dict[str, float]:
    enum_started = time.perf_counter()
    states = reachable_states(Geometry(model))
    enum_s = time.perf_counter() - enum_started

    pairs = [(p.id, s) for p in model.profiles for s in range(model.memory_units)]
    queries = [(rng.choice(states), *rng.choice(pairs)) for _ in range(20_000)]

    warm = Geometry(model)
    for state in states:
        warm.admits(state)

    def fits_cached() -> int:
        fits = warm.fits
        for state, pid, start in queries:
            fits(state, pid, start)
        return len(queries)

    def admits_cached() -> int:
        admits = warm.admits
        for state, _, _ in queries:
            admits(state)
        return len(queries)

    # Cold: equal but distinct state objects, so nothing (not even the cached hash) is reused.
    def admits_cold() -> int:
        cold = Geometry(model)
        fresh = [GpuState(s.instances, s.occupied, s.engines) for s in states]
        for state in fresh:
            cold.admits(state)
        return len(fresh)

    placeable = [
        (s, pid, start)
        for s in states
        for pid in warm.profile_ids
        for start in warm.feasible_starts(s, pid)
    ]
    sample = [rng.choice(placeable) for _ in range(20_000)] if placeable else []

    def place_cached() -> int:
        place = warm.place
        for state, pid, start in sample:
            place(state, pid, start)
        return len(sample)

    return {
        "states": len(states),
        "enumerate_ms": enum_s * 1000,
        "fits_cached": _rate(fits_cached, seconds),
        "admits_cold": _rate(admits_cold, seconds),
        "admits_cached": _rate(admits_cached, seconds),
        "place_cached": _rate(place_cached, seconds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    rng = random.Random(7)
    header = (
        f"{'model':<24}{'states':>8}{'enum ms':>9}{'fits/s warm':>14}"
        f"{'admits/s cold':>15}{'admits/s warm':>15}{'place/s warm':>14}"
    )
    print(header)
    print("-" * len(header))
    for key in args.models:
        r = bench_model(gpu_model(key), args.seconds, rng)
        print(
            f"{key:<24}{r['states']:>8.0f}{r['enumerate_ms']:>9.1f}{r['fits_cached']:>14,.0f}"
            f"{r['admits_cold']:>15,.0f}{r['admits_cached']:>15,.0f}{r['place_cached']:>14,.0f}"
        )


if __name__ == "__main__":
    main()
