"""The namespace-flood benchmark's machinery at a small count, so `python -m bench.flood`
cannot rot, and the namespace share (issue 41.5) against the real apiserver: a real
carve-controller with a share of 5 and a flood of more pods than the batch node holds. Pods
shed at first must be read again and placed as the kept ones are, until the node is full;
the other namespace's pods are all placed. Outcomes only, never timings or sizes (the figures
are the bench's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from tests.support import promtext
from tests.support.flood import FloodConfig, FloodRun

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SHARE = 5
FLOOD = 70
BATCH_NODE_SLICES = 56  # the one batch node: eight A100s, seven 1g slices each


def test_shed_pods_are_taken_up_in_turn_and_another_namespace_is_placed(
    k8s_cluster: LocalCluster, tmp_path: Path
) -> None:
    cfg = FloodConfig(
        pods=FLOOD, tenant_pods=6, gpu_nodes=2, creators=4, placed_timeout_s=120.0,
        extra=(f"--namespace-pod-share={SHARE}",),
    )  # fmt: skip
    run = FloodRun(k8s_cluster.info, tmp_path, cfg)
    try:
        run.install()
        figures, controller = run.run("this", None, keep=True)
        assert controller is not None
        try:
            assert figures.tenant_placed == cfg.tenant_pods, figures.describe()

            def node_full() -> tuple[int, int] | None:
                placed = run.flood_placed()
                shed = int(promtext.counter_sum(controller.metrics(), "carve_shed_pods"))
                # The end state, not a moment on the way there (the sum holds all along): the
                # batch node is full, and every other flood pod is kept waiting or shed.
                full = placed == BATCH_NODE_SLICES and placed + SHARE + shed == FLOOD
                return (placed, shed) if full else None

            placed, shed = wait_for("the batch node to fill", node_full, timeout=180)
            text = controller.metrics()
        finally:
            controller.stop()
    finally:
        run.close()
    print(figures.describe(), f"flood placed {placed}, shed now {shed}")
    assert placed > 6 * SHARE  # far more than the share: shed pods came back and were placed
    assert shed == FLOOD - BATCH_NODE_SLICES - SHARE  # the rest wait outside the share
    assert promtext.counter_sum(text, "carve_pods_shed_total") >= shed
