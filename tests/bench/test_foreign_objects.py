"""The foreign-objects benchmark's machinery at a small count, so `python -m
bench.foreign_objects` cannot rot: a real control plane, a small fake GPU fleet, a few hundred
of another driver's claims and slices, the real carve-controller placing gated pods. Outcomes
only, never timings or sizes (the figures are the bench's; docs/scale.md quotes them)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from tests.support.foreign import ForeignBench, ForeignConfig, bytes_per_object

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_a_foreign_claim_costs_the_controller_nothing() -> None:
    sizes = bytes_per_object(samples=100)
    nothing = 16  # tracemalloc's own noise per sample; a kept claim is hundreds of bytes
    assert sizes["foreign claim"] < nothing
    assert sizes["foreign slice"] < nothing
    assert sizes["carve claim (allocated)"] > 20 * nothing and sizes["gated pod"] > 20 * nothing


def test_foreign_objects_machinery_measures_each_count(
    k8s_cluster: LocalCluster,
    tmp_path: Path,
) -> None:
    cfg = ForeignConfig(counts=(0, 300), gpu_nodes=1, pods=4, creators=4)
    bench = ForeignBench(k8s_cluster.info, tmp_path, cfg)
    try:
        bench.install()
        figures = list(bench.run())
    finally:
        bench.close()
    print(figures)
    assert [f.foreign_claims for f in figures] == [0, 300]
    assert [f.foreign_slices for f in figures] == [0, 300]
    for f in figures:
        assert f.placed == cfg.pods, "every gated pod was placed"
        assert f.decisions >= cfg.pods
        assert not math.isnan(f.decision_mean_ms) and f.rss_ready_mb > 0
