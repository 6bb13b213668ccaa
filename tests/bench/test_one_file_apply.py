"""The one-file-apply benchmark's machinery at a small count, so `python -m
bench.one_file_apply` cannot rot: a real control plane, the shipped policies, template churn,
and a handful of one-file applies, every one placed by carve."""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from tests.support.onefile import OneFileBench, OneFileConfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_one_file_applies_are_counted_and_placed_by_carve(
    k8s_cluster: LocalCluster,
    tmp_path: Path,
) -> None:
    bench = OneFileBench(k8s_cluster.info, tmp_path, OneFileConfig(applies=5, gpu_nodes=1), print)
    try:
        bench.install()
        figures = bench.run()
    finally:
        bench.close()
    print(figures.row())
    assert figures.applies == 5
    assert figures.gated + figures.escaped == 5
    assert figures.placed_by_carve == 5 and figures.placed_by_scheduler == 0
    assert figures.churned_templates > 0
