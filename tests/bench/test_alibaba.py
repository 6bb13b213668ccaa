"""The trace loader and the MIG mapping do what the trace's README says."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.claims import ClaimKey, parse_claim_spec
from controller.nodefit import PodNeeds, Resources
from controller.placement import NoPlacement, PlacementEngine, PlacementRequest
from controller.placement.values import ClaimToPlace
from driver.catalog import gpu_model
from tests.bench.alibaba import (
    DEFAULT_TASKS,
    DRIVER,
    MODEL_MAP,
    NODE_FILE,
    REFERENCE_MODEL,
    TRACE_DIR,
    TRACE_REQUIRED,
    TraceNode,
    TraceTask,
    claim_spec,
    load_nodes,
    load_tasks,
    map_task,
    smallest_profile,
)
from tests.bench.replay import CLASSES, build_jobs, build_model, cluster_gpus, select_nodes

needs_trace = pytest.mark.skipif(
    not (TRACE_DIR / NODE_FILE).exists() and not TRACE_REQUIRED,
    reason=f"trace not found in {TRACE_DIR} (set CARVE_TRACE_DIR)",
)
MODELS = sorted(set(MODEL_MAP.values()))


def task(milli: int, num: int = 1, spec: tuple[str, ...] = (), **kw: int) -> TraceTask:
    return TraceTask("t", kw.get("cpu", 1000), kw.get("mem", 1024), num, milli, spec, None, None)


@needs_trace
def test_the_files_hold_what_the_readme_says() -> None:
    nodes = load_nodes(TRACE_DIR / NODE_FILE)
    assert 1150 <= len(nodes) <= 1250  # "~1,200 GPU nodes"
    assert {n.model for n in nodes} <= set(MODEL_MAP)  # every model has a mapping
    tasks = load_tasks(TRACE_DIR / DEFAULT_TASKS)
    assert len(tasks) == 8152
    assert sum(1 for t in tasks if t.num_gpu > 0) == 7064  # "7,064 use GPUs"
    assert all(t.creation is not None and t.deletion is not None for t in tasks)
    assert all(0 <= t.num_gpu <= 8 for t in tasks)


@needs_trace
def test_a_variant_without_times_loads_and_replays_in_saturation_mode() -> None:
    tasks = load_tasks(TRACE_DIR / "openb_pod_list_multigpu30.csv")
    assert tasks and all(t.creation is None for t in tasks)
    nodes = select_nodes(load_nodes(TRACE_DIR / NODE_FILE), 20)
    assert build_jobs(tasks, nodes, load=1.0)
    with pytest.raises(ValueError, match="creation_time"):
        build_jobs(tasks, nodes, mode="timeline")


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("name,cpu_milli\na,1\n")
    with pytest.raises(ValueError, match="lacks"):
        load_tasks(path)


def test_nodes_keep_cpu_memory_and_gpu_count() -> None:
    nodes = [TraceNode("n0", 96000, 393216, 8, "G2"), TraceNode("n1", 16000, 122880, 2, "P100")]
    model = build_model(nodes)
    for n in nodes:
        info = model.nodes[n.name]
        assert info.allocatable.cpu_milli == n.cpu_milli
        assert info.allocatable.memory == n.memory_mib * 2**20
        gpus = model.gpus_on(n.name)
        assert len(gpus) == n.gpus
        assert {g.inventory.model.key for g in gpus} == {MODEL_MAP[n.model]}


@given(st.integers(1, 999), st.sampled_from(MODELS))
def test_the_profile_is_the_smallest_whose_compute_share_covers_gpu_milli(
    milli: int, key: str
) -> None:
    model = gpu_model(key)
    chosen = smallest_profile(model, milli)
    assert chosen.slices / model.compute_slices >= milli / 1000
    assert "+" not in chosen.name and not chosen.name.endswith("-me")
    smaller = [p for p in model.profiles if p.slices < chosen.slices]
    assert all(p.slices / model.compute_slices < milli / 1000 for p in smaller)
    same = [p for p in model.profiles if p.slices == chosen.slices]
    assert chosen.size == min(p.size for p in same)


@pytest.mark.parametrize(
    ("milli", "h100", "a30", "a100_40"),
    [
        (50, "1g.10gb", "1g.6gb", "1g.5gb"),
        (160, "2g.20gb", "1g.6gb", "2g.10gb"),
        (320, "3g.40gb", "2g.12gb", "3g.20gb"),
        (460, "4g.40gb", "2g.12gb", "4g.20gb"),
        (810, "7g.80gb", "4g.24gb", "7g.40gb"),
    ],
)
def test_examples_of_the_mapping(milli: int, h100: str, a30: str, a100_40: str) -> None:
    request = map_task(task(milli), ["A30-24GB", "A100-SXM4-40GB", "H100-SXM5-80GB"])
    assert request is not None and not request.whole
    assert dict(request.profiles) == {
        "H100-SXM5-80GB": h100,
        "A30-24GB": a30,
        "A100-SXM4-40GB": a100_40,
    }
    assert request.share == smallest_profile(gpu_model(REFERENCE_MODEL), milli).size / 8


def test_whole_gpus_cpu_only_tasks_and_gpu_spec() -> None:
    assert map_task(task(0, num=0), MODELS) is None
    whole = map_task(task(1000, num=8), MODELS)
    assert whole is not None and whole.whole and whole.count == 8 and whole.share == 8
    one = map_task(task(1000), MODELS)
    assert one is not None and one.whole and one.count == 1
    t4_only = map_task(task(460, spec=("T4",)), MODELS)
    assert t4_only is not None and t4_only.models == ("A30-24GB",)
    assert dict(t4_only.profiles) == {"A30-24GB": "2g.12gb"}
    v100 = map_task(task(1000, spec=("V100M16", "V100M32")), MODELS)
    assert v100 is not None and v100.models == ("A100-SXM4-40GB", "A100-SXM4-80GB")


@pytest.mark.parametrize(
    ("milli", "num", "spec", "expect"),
    [
        (460, 1, (), {"A30-24GB": "2g.12gb", "H100-SXM5-80GB": "4g.40gb"}),
        (460, 1, ("T4",), {"A30-24GB": "2g.12gb"}),
        (1000, 2, (), {"A30-24GB": "gpu", "H100-SXM5-80GB": "gpu"}),
        (1000, 1, ("G2",), {"H100-SXM5-80GB": "gpu"}),
    ],
)
def test_the_claim_gets_the_mapped_profile_on_each_model(
    milli: int, num: int, spec: tuple[str, ...], expect: dict[str, str]
) -> None:
    """carve's own parser and engine read the claim the replay hands both schedulers: on a
    node of each model it gets exactly the mapped profile (or whole GPUs), and nowhere else."""
    request = map_task(task(milli, num=num, spec=spec), ["A30-24GB", "H100-SXM5-80GB"])
    assert request is not None
    parsed = parse_claim_spec(claim_spec(request), DRIVER)
    for trace_model, key in (("T4", "A30-24GB"), ("G2", "H100-SXM5-80GB")):
        model = build_model([TraceNode("n", 64000, 262144, 2, trace_model)])
        engine = PlacementEngine(model, CLASSES, DRIVER)
        claim = ClaimToPlace(ClaimKey("t", "c", "c"), parsed)
        result = engine.place(PlacementRequest("t/p", PodNeeds(Resources(1000, 1, 1)), (claim,)))
        if key not in expect:
            assert isinstance(result, NoPlacement)
            continue
        assert not isinstance(result, NoPlacement), result.message
        assert [c.profile for c in result.choices] == [expect[key]] * num


def _timed(name: str, creation: int, deletion: int, milli: int = 460) -> TraceTask:
    return TraceTask(name, 1000, 1024, 1, milli, (), creation, deletion)


def test_timeline_divides_arrival_gaps_and_keeps_lifetimes() -> None:
    nodes = [TraceNode("n0", 96000, 393216, 8, "G2")]
    tasks = [_timed("a", 100, 200), _timed("b", 1100, 1150), _timed("c", 600, 5000)]
    jobs = build_jobs(tasks, nodes, mode="timeline", speedup=10)
    assert [(j.pod, j.arrival, j.departure) for j in jobs] == [
        ("a", 100, 200),
        ("c", 150, 4550),
        ("b", 200, 250),
    ]


def test_saturation_offers_the_load_and_samples_the_whole_trace() -> None:
    nodes = [TraceNode(f"n{i}", 96000, 393216, 8, "G2") for i in range(2)]
    tasks = [_timed(f"t{i}", i, i + 1, milli=1000) for i in range(100)]
    jobs = build_jobs(tasks, nodes, load=1.5)
    assert sum(j.request.share for j in jobs) >= 1.5 * cluster_gpus(nodes)
    assert len(jobs) == 24
    # A small cluster takes tasks from all over the trace, not only its first ones.
    assert max(int(j.pod[1:]) for j in jobs) > 90
    assert all(j.departure is None for j in jobs)
    # A trace too short for the load is cycled under new pod names.
    again = build_jobs(tasks[:5], nodes, load=1.0)
    assert len(again) == 16 and len({j.pod for j in again}) == 16
