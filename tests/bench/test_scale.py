"""The scale benchmark's machinery on a small fleet, so `python -m bench.scale` cannot rot:
a real control plane, 20 fake GPU nodes with the plugin's slices, the real carve-controller
process, pods churned through it. Only outcomes are checked, never timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from tests.support.gpufleet import fleet_node, node_slices
from tests.support.scale import ScaleBench, ScaleConfig, figures_json
from tests.support.scale_burst import summary_line
from tests.support.scale_processes import started_on_cpus

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = 20


def test_fleet_nodes_publish_the_plugins_pool() -> None:
    slices = node_slices(fleet_node(3), "mig.carve.dev")
    pools = {s["spec"]["pool"]["name"] for s in slices}
    assert pools == {fleet_node(3).name}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    # Counters in their own slices (1.35+), one counter set and one device slice per GPU.
    assert sum(1 for s in slices if s["spec"].get("sharedCounters")) == 8
    assert sum(1 for s in slices if s["spec"].get("devices")) == 8


def test_a_process_started_on_cpus_keeps_them_and_the_starter_gets_its_own_back() -> None:
    mine = os.sched_getaffinity(0)
    one = frozenset({max(mine)})
    child = started_on_cpus(
        one,
        lambda: subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        ),
    )
    assert child.stdout.strip() == str(sorted(one))
    assert os.sched_getaffinity(0) == mine


@pytest.mark.timeout(1500)  # the churn, then a burst on the carve path and on the native path
def test_scale_machinery_places_and_releases_every_pod(
    k8s_cluster: LocalCluster,
    tmp_path: Path,
) -> None:
    cfg = ScaleConfig(
        node_counts=(NODES,),
        rate=4.0,
        duration_s=3.0,
        hold_s=1.0,
        drain_s=180.0,
        creators=2,
        backlog=6,
        controller_cpus=frozenset({max(os.sched_getaffinity(0))}),
        burst=8,
        burst_creators=4,
    )
    bench = ScaleBench(k8s_cluster.info, tmp_path, cfg, progress=print)
    try:
        bench.install()
        [figures] = bench.run_size(NODES)
    finally:
        bench.close()
    print(figures)
    assert (figures.nodes, figures.gpus) == (NODES, NODES * 8)
    assert figures.slices == NODES * 16
    assert figures.created == 12
    assert figures.placed == figures.created, "every churned pod is placed by carve"
    assert figures.bound == figures.created, "and bound by kube-scheduler"
    assert figures.bound_off_fleet == 0
    assert not figures.left_behind, "deleted pods' claims were released"
    assert figures.decisions >= figures.created
    assert not math.isnan(figures.decision_p99_ms)
    assert figures.decision_cpu_p99_ms <= figures.decision_p99_ms, "CPU time within wall time"
    assert figures.requests > 0, "the controller counted its requests"
    assert figures.apf_requests > 0, "and so did its FlowSchema"
    assert figures.rss_peak_mb >= figures.rss_start_mb > 0
    assert (figures.backlog, figures.backlog_placed) == (6, 6), "the queued pods were placed"
    assert figures.backlog_rate > 0
    carve, [native] = figures.burst, bench.native
    assert carve is not None
    for burst in (carve, native):
        assert (burst.pods, burst.bound, burst.released) == (8, 8, 8), burst.describe()
        assert burst.to_last_bound_s > 0
    assert carve.requests_per_placement >= 2, "at least the allocation and the gate"
    assert carve.requests_per_release >= 1, "at least the finalizer"
    assert native.cpu_ms_per_pod("kube-scheduler") > 0
    assert native.placing.carve == {}, "no controller ran on the native path"
    written = json.loads(figures_json([figures], [native]))  # what `--json` writes
    assert written["controllers"][0]["burst"]["placing"]["carve"]["patch pods"] == carve.bound
    assert written["native"][0]["bound"] == 8
    line = summary_line(NODES, carve, native, figures.rss_peak_mb)
    assert line.startswith(f"nodes={NODES} requests_per_placement=")
    assert "nan" not in line, line
