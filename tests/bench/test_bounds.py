"""The bounds are bounds: small LPs solve right, configurations obey MIG geometry, and no
policy places more than the bounds allow."""

from __future__ import annotations

import pytest

from controller.placement.scoring import Policy
from driver.catalog import gpu_model
from driver.geometry import geometry_for
from tests.bench.alibaba import TraceNode, TraceTask
from tests.bench.bounds import WHOLE, configuration_bound, configurations, maximise
from tests.bench.replay import build_jobs, build_model, carve, fluid_bound, replay


def test_maximise_solves_small_programs() -> None:
    assert maximise([1, 1], [[1, 2], [3, 1]], [4, 6]) == pytest.approx(2.8)
    assert maximise([3, 2], [[1, 1], [1, 0]], [4, 3]) == pytest.approx(11)
    assert maximise([1], [[1]], [0]) == pytest.approx(0)


def test_configurations_are_creatable_and_maximal() -> None:
    model = gpu_model("H100-SXM5-80GB")
    names = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    configs = configurations(model, names)
    assert {WHOLE: 1} in configs
    assert {"3g.40gb": 1, "4g.40gb": 1} in configs
    assert {"1g.10gb": 7} in configs
    assert not any(c.get("4g.40gb", 0) > 1 for c in configs)  # one 4g per GPU
    geometry = geometry_for(model)
    by_name = {p.name: p for p in model.profiles}
    for c in configs:
        if WHOLE in c:
            continue
        # Creatable: some order of placements builds it (largest first, any start).
        state = geometry.state_of(())
        for name in sorted(c, key=lambda n: -by_name[n].size):
            for _ in range(c[name]):
                starts = geometry.feasible_starts(state, by_name[name].id)
                assert starts, (c, name)
                state = geometry.place(state, by_name[name].id, starts[-1])


def _tasks() -> list[TraceTask]:
    millis = [460, 470, 320, 1000, 810, 110, 220, 460, 1000, 550] * 6
    return [TraceTask(f"t{i}", 4000, 8192, 1, m, (), None, None) for i, m in enumerate(millis)] + [
        TraceTask("big", 8000, 8192, 4, 1000, (), None, None)
    ]


def test_no_policy_beats_the_bounds_and_the_lp_is_tighter() -> None:
    nodes = [
        TraceNode("n0", 96000, 393216, 8, "G2"),
        TraceNode("n1", 32000, 131072, 4, "V100M16"),
        TraceNode("n2", 16000, 122880, 2, "P100"),
    ]
    jobs = build_jobs(_tasks(), nodes, load=1.5)
    fluid = fluid_bound(nodes, jobs)
    lp = configuration_bound(nodes, jobs)
    assert lp.share <= fluid.share + 1e-6
    assert lp.jobs <= fluid.jobs + 1e-6
    for policy in Policy:
        figures = replay(build_model(nodes), jobs, carve(policy))
        assert figures.share_placed <= lp.share + 1e-6
        assert figures.placed <= lp.jobs + 1e-6


def test_the_lp_knows_one_4g_per_gpu() -> None:
    """Only 4g requests on 8-slice GPUs: the fluid bound fills every slice, the LP half."""
    nodes = [TraceNode("n0", 96000, 393216, 8, "G2")]
    tasks = [TraceTask(f"t{i}", 1000, 1024, 1, 460, (), None, None) for i in range(32)]
    jobs = build_jobs(tasks, nodes, load=2.0)
    assert fluid_bound(nodes, jobs).share == pytest.approx(8)
    assert configuration_bound(nodes, jobs).share == pytest.approx(4)
    assert replay(build_model(nodes), jobs, carve(Policy.BEST_FIT)).share_placed == 4


def test_the_lp_counts_cpu_per_model() -> None:
    """Two whole-GPU jobs need 12 cores each; a 16-core node with 2 GPUs holds one."""
    nodes = [TraceNode("n0", 16000, 122880, 2, "P100")]
    tasks = [TraceTask(f"t{i}", 12000, 1024, 1, 1000, (), None, None) for i in range(4)]
    jobs = build_jobs(tasks, nodes, load=2.0)
    assert fluid_bound(nodes, jobs).share == pytest.approx(2)
    assert configuration_bound(nodes, jobs).share == pytest.approx(16 / 12)
