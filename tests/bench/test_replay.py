"""The trace replay: carve's engine and kube-scheduler's allocator on the same jobs.

The comparison is measured, not asserted against a figure: on a small slice of each trace
variant, carve's least-waste policy (the one the benchmark measured best, docs/benchmarks.md)
places at least the GPU share the real allocator places in the same run. Needs dra-allocate
(built with the control plane by hack/k8s/build.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.model import ClusterModel
from controller.placement.scoring import Policy
from driver.catalog import gpu_model
from tests.bench.alibaba import (
    NODE_FILE,
    TRACE_DIR,
    TRACE_REQUIRED,
    TraceNode,
    TraceTask,
    load_nodes,
    load_tasks,
)
from tests.bench.replay import (
    Job,
    RealScheduler,
    Scheduler,
    build_jobs,
    build_model,
    carve,
    real,
    replay,
    select_nodes,
)
from tests.support.real_allocator import (
    CachedAllocator,
    allocate,
    node_slices,
    profile_claim,
    release,
    run_steps,
)

MEASURED_BEST = Policy.LEAST_WASTE
needs_trace = pytest.mark.skipif(
    not (TRACE_DIR / NODE_FILE).exists() and not TRACE_REQUIRED,
    reason=f"trace not found in {TRACE_DIR} (set CARVE_TRACE_DIR)",
)


def _small_jobs() -> tuple[list[TraceNode], list[Job]]:
    nodes = [
        TraceNode("n0", 96000, 393216, 8, "G2"),
        TraceNode("n1", 16000, 122880, 2, "P100"),
        TraceNode("n2", 32000, 131072, 4, "V100M16"),
    ]
    millis = [460, 1000, 320, 810, 110, 220, 470, 1000, 550, 160] * 3
    tasks = [TraceTask(f"t{i}", 2000, 4096, 1, m, (), None, None) for i, m in enumerate(millis)]
    tasks.append(TraceTask("pair", 4000, 4096, 2, 1000, (), None, None))
    return nodes, build_jobs(tasks, nodes, load=1.3)


def test_the_allocator_places_only_where_geometry_allows(dra_allocate: Path) -> None:
    nodes, jobs = _small_jobs()
    allocator = CachedAllocator(dra_allocate)
    box: dict[str, tuple[ClusterModel, RealScheduler]] = {}

    def make(model: ClusterModel, upcoming: object) -> Scheduler:
        scheduler = real(allocator)(model, upcoming)  # type: ignore[arg-type]
        assert isinstance(scheduler, RealScheduler)
        box["s"] = (model, scheduler)
        return scheduler

    figures = replay(build_model(nodes), jobs, make)
    model, scheduler = box["s"]
    assert scheduler.disagreements == 0
    assert not model.problems  # no device twice, no overlapping placements
    assert 0 < figures.placed < len(jobs)
    for j in jobs:
        holds = [h for h in model.holds() if h.claim.name == j.pod]
        if holds:
            assert len(holds[0].devices) == j.request.count
    # Every answer came from dra-allocate or from its cache; replaying gives the same result.
    again = replay(build_model(nodes), jobs, real(allocator))
    assert (again.placed, again.share_placed) == (figures.placed, figures.share_placed)


@needs_trace
@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "openb_pod_list_default.csv",
        "openb_pod_list_gpushare100.csv",
        "openb_pod_list_multigpu30.csv",
    ],
)
def test_carve_places_at_least_what_the_real_allocator_places(
    dra_allocate: Path, variant: str
) -> None:
    nodes = select_nodes(load_nodes(TRACE_DIR / NODE_FILE), 30)
    jobs = build_jobs(load_tasks(TRACE_DIR / variant), nodes, load=1.2)
    ours = replay(build_model(nodes), jobs, carve(MEASURED_BEST))
    theirs = replay(build_model(nodes), jobs, real(CachedAllocator(dra_allocate)))
    assert theirs.placed > 0
    assert ours.share_placed >= theirs.share_placed, (
        f"{variant}: carve {MEASURED_BEST.value} placed {ours.share_fraction:.3f} of the "
        f"offered GPU share, kube-scheduler's allocator {theirs.share_fraction:.3f}"
    )


def test_pinned_devices_rebuild_the_state_the_history_built(dra_allocate: Path) -> None:
    """CachedAllocator asks about a state by pinning its devices instead of replaying how it
    came about; the allocator's next choice must be the same either way."""
    model = gpu_model("A100-SXM4-40GB")
    slices = node_slices([model, model])
    names = ["1g.5gb", "3g.20gb", "2g.10gb", "1g.5gb", "4g.20gb", "1g.10gb", "1g.5gb"]
    steps = [allocate(profile_claim(f"c{i}", n)) for i, n in enumerate(names)]
    steps[3:3] = [release("c1")]
    history = run_steps(slices, steps, exe=dra_allocate)
    held = {v.claim: v.devices for v in history if v.allocated}
    held.pop("c1")
    last = held.pop(f"c{len(names) - 1}")
    spec = profile_claim("x", names[-1])["spec"]
    answer = CachedAllocator(dra_allocate).allocate(
        [model, model], frozenset(d for ds in held.values() for d in ds), spec
    )
    assert answer == last
