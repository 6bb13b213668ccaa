"""The pure parts of `python -m bench.cluster_packing`: workloads, the MIG-native mix, the
figures computed from an arm's records, and the arm names. No control plane here
(tests/bench/test_cluster_packing.py runs the machinery)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.placement import DEFAULT_POLICY, Policy
from driver.allocation import AllocatedDevice
from tests.bench.alibaba import (
    DEFAULT_TASKS,
    DRIVER,
    NODE_FILE,
    TRACE_DIR,
    TRACE_REQUIRED,
    MappedRequest,
    claim_spec,
    load_nodes,
    load_tasks,
)
from tests.bench.cluster_figures import JobRecord, arm_figures, fleet_model
from tests.bench.cluster_workload import (
    NodeSpec,
    RawJob,
    TimedJob,
    Timing,
    Workload,
    size_class,
    timed,
    trace_workload,
)
from tests.bench.mig_mix import INFERENCE, MIXES, describe_mix, fleet, mix_named, mix_workload
from tests.support.cluster_packing import fleet_slices
from tests.support.packing_arms import parse_arm, parse_arms

H100 = "H100-SXM5-80GB"
_1G = MappedRequest(False, 1, (H100,), ((H100, "1g.10gb"),), 1 / 8)
_3G = MappedRequest(False, 1, (H100,), ((H100, "3g.40gb"),), 4 / 8)
_7G = MappedRequest(False, 1, (H100,), ((H100, "7g.80gb"),), 1.0)
_GPU2 = MappedRequest(True, 2, (H100,), (), 2.0)


def test_size_classes() -> None:
    assert [size_class(r) for r in (_1G, _3G, _7G, _GPU2)] == ["1g", "2g-4g", "7g", "multi-GPU"]
    assert size_class(MappedRequest(True, 1, (H100,), (), 1.0)) == "7g"


# ---------------------------------------------------------------------------------------------
# Time


def _raw(n: int, life: float = 1.0) -> list[RawJob]:
    return [RawJob(f"r{i}", _3G, 1000, 1024, float(i), life) for i in range(n)]


def test_lifetimes_are_scaled_to_offer_the_load_over_the_window() -> None:
    timing = Timing(jobs=200, rate=2.0, load=1.3, window_from=0.5, min_run=1.0, max_run=80.0)
    jobs, k = timed(_raw(200), gpus=4, timing=timing)
    assert jobs[-1].arrival == pytest.approx(100.0, abs=0.6), "200 jobs at 2/s span 100 s"
    w = Workload("w", "", (NodeSpec("n", H100, 4, 64_000, 65536),), tuple(jobs), k, 0.5)
    assert w.window == (pytest.approx(jobs[-1].arrival / 2), jobs[-1].arrival)
    assert w.offered_load() == pytest.approx(1.3, rel=1e-3)
    assert all(1.0 <= j.lifetime <= 80.0 for j in jobs)
    # Twice the GPUs need twice the work, so longer lifetimes.
    _, k2 = timed(_raw(200), gpus=8, timing=timing)
    assert k2 > k


def test_a_load_the_lifetimes_cannot_reach_keeps_the_longest() -> None:
    timing = Timing(jobs=10, rate=1.0, load=50.0, min_run=1.0, max_run=5.0)
    jobs, _ = timed(_raw(10), gpus=4, timing=timing)
    assert {j.lifetime for j in jobs} == {5.0}


# ---------------------------------------------------------------------------------------------
# The MIG-native mix


def test_the_default_mix_comes_first_and_every_parameter_is_described() -> None:
    assert MIXES[0] is INFERENCE
    assert mix_named("inference") is INFERENCE
    with pytest.raises(ValueError, match="known: inference"):
        mix_named("training")
    text = "\n".join(describe_mix(INFERENCE))
    for share in INFERENCE.fleet:
        assert share.model in text and share.why in text
    for c in INFERENCE.classes:
        assert c.name in text and c.why in text
    assert sum(c.weight for c in INFERENCE.classes) == pytest.approx(1.0)
    assert sum(f.fraction for f in INFERENCE.fleet) == pytest.approx(1.0)


def test_the_fleet_keeps_the_proportions_and_interleaves_the_models() -> None:
    nodes = fleet(INFERENCE, 20)
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n.model] = counts.get(n.model, 0) + 1
    assert counts == {
        "A100-SXM4-40GB": 3,
        "A100-SXM4-80GB": 5,
        "H100-SXM5-80GB": 6,
        "H200-SXM5-141GB": 2,
        "A30-24GB": 4,
    }
    assert len({n.model for n in nodes[:5]}) >= 4, "the first nodes already mix the models"
    assert len({n.name for n in nodes}) == 20


def test_a_mix_is_drawn_from_its_seed_alone() -> None:
    timing = Timing(jobs=400, rate=4.0)
    a, b = mix_workload(INFERENCE, 10, timing, 7), mix_workload(INFERENCE, 10, timing, 7)
    assert a == b
    assert mix_workload(INFERENCE, 10, timing, 8).jobs != a.jobs
    by_class = a.by_class()
    assert by_class["1g"] > by_class["2g-4g"] > by_class["7g"] > by_class["multi-GPU"] > 0
    assert a.offered_load() == pytest.approx(timing.load, rel=1e-3)
    for job in a.jobs:
        spec = claim_spec(job.request)  # every request makes a claim
        assert spec["devices"]["requests"][0]["exactly"]
        if job.size_class == "multi-GPU":
            assert job.request.count in (4, 8)
            assert "A30-24GB" not in job.request.models
        elif job.size_class == "7g":
            assert dict(job.request.profiles)[H100] == "7g.80gb"
            assert "A30-24GB" not in job.request.models
    three = next(j for j in a.jobs if dict(j.request.profiles).get(H100) == "3g.40gb")
    assert three.request.share == 0.5


# ---------------------------------------------------------------------------------------------
# The trace


@pytest.fixture(scope="module")
def trace_dir() -> Path:
    if not (TRACE_DIR / NODE_FILE).exists():
        if TRACE_REQUIRED:
            raise RuntimeError(f"the trace is missing from {TRACE_DIR}")
        pytest.skip(f"no trace in {TRACE_DIR}")
    return TRACE_DIR


def test_a_trace_stretch_keeps_the_tasks_order_cpu_and_memory(trace_dir: Path) -> None:
    tasks = load_tasks(trace_dir / DEFAULT_TASKS)
    nodes = load_nodes(trace_dir / NODE_FILE)
    timing = Timing(jobs=300, rate=3.0)
    w = trace_workload("default", tasks, nodes, node_count=20, timing=timing, seed=2)
    assert w == trace_workload("default", tasks, nodes, node_count=20, timing=timing, seed=2)
    assert len(w.jobs) == 300 and len(w.nodes) == 20
    assert [j.arrival for j in w.jobs] == sorted(j.arrival for j in w.jobs)
    assert w.offered_load() == pytest.approx(timing.load, rel=1e-3)
    by_cpu = {(t.cpu_milli, t.memory_mib) for t in tasks}
    assert all((j.cpu_milli, j.memory_mib) in by_cpu for j in w.jobs)
    other = trace_workload("default", tasks, nodes, node_count=20, timing=timing, seed=3)
    assert other.jobs != w.jobs, "another seed, another stretch"


def test_a_trace_without_times_gets_poisson_arrivals(trace_dir: Path) -> None:
    tasks = load_tasks(trace_dir / "openb_pod_list_multigpu30.csv")
    assert all(t.creation is None for t in tasks)
    nodes = load_nodes(trace_dir / NODE_FILE)
    timing = Timing(jobs=300)
    w = trace_workload("multigpu30", tasks, nodes, node_count=8, timing=timing, seed=1)
    assert "Poisson" in w.description
    assert w.offered_load() == pytest.approx(timing.load, rel=1e-3)
    assert len({j.lifetime for j in w.jobs}) > 100, "exponential lifetimes, scaled"
    gaps = {round(b.arrival - a.arrival, 3) for a, b in zip(w.jobs, w.jobs[1:], strict=False)}
    assert len(gaps) > 100, "exponential gaps"


# ---------------------------------------------------------------------------------------------
# Figures


def _workload() -> Workload:
    jobs = (
        TimedJob("a", _3G, 1000, 1024, 0.0, 100.0),
        TimedJob("b", _3G, 1000, 1024, 0.0, 100.0),
        TimedJob("c", _7G, 1000, 1024, 10.0, 100.0),
        TimedJob("d", _1G, 1000, 1024, 20.0, 5.0),
    )
    return Workload("w", "", (NodeSpec("n0", H100, 2, 64_000, 65536),), jobs, 1.0, 0.0)


def _device(node: str, minor: int, profile: str, start: int) -> AllocatedDevice:
    compact = profile.replace(".", "")
    pid = {"3g40gb": 9, "7g80gb": 0, "1g10gb": 19}[compact]
    return AllocatedDevice("gpu", DRIVER, node, f"gpu-{minor}-mig-{compact}-{pid}-{start}")


def test_figures_follow_the_records() -> None:
    w = _workload()
    # a and b share GPU 0 (3g at 0 and at 4); c (a 7g) is never bound; d runs on GPU 1 from
    # 22 s to 27 s.
    records = {
        "a": JobRecord("a", 0.0, 1.0, "n0", (_device("n0", 0, "3g.40gb", 0),), 101.0),
        "b": JobRecord("b", 0.0, 2.0, "n0", (_device("n0", 0, "3g.40gb", 4),), 102.0),
        "c": JobRecord("c", 10.0),
        "d": JobRecord("d", 20.0, 22.0, "n0", (_device("n0", 1, "1g.10gb", 6),), 27.0),
    }
    model = fleet_model(w.nodes)
    f = arm_figures("carve-best-fit", w, records, model, end=40.0, sample_s=1.0)
    assert (f.jobs, f.placed, f.placed_by_horizon) == (4, 3, 2), "d was bound after 20 s"
    # The window is 0-20 s: a holds 0.5 from 1 s, b 0.5 from 2 s, of 2 GPUs.
    assert f.share == pytest.approx((19 * 0.5 + 18 * 0.5) / (20 * 2))
    assert f.waits["2g-4g"].p50 == 1.0 and f.waits["2g-4g"].p99 == 2.0
    assert f.waits["7g"].p99 == 30.0 and f.waits["7g"].unplaced == 1, "waited until the end"
    assert f.large.p99 == 30.0 and f.max_large_wait == 30.0
    assert f.waits["multi-GPU"].jobs == 0
    # GPU 0 is full: its memory slices are all held once b runs.
    assert 0.45 < f.util <= 0.5
    # c waits from 10 s, but GPU 1 is free all through the window: nothing is stuck.
    assert f.frag == 0.0
    assert 0 < f.of_bound <= 1.0 and 0 < f.bound <= f.fluid <= 1.0
    assert f.summary_line() == (
        f"arm=carve-best-fit share={f.share:.4f} jobs=0.7500 large_p99_wait_s=30.0"
    )
    assert not f.notes


def test_free_share_that_cannot_host_the_largest_waiting_request_is_fragmentation() -> None:
    w = _workload()
    # A 1g on each GPU: 7/8 of both GPUs is free, but the 7g (c) waiting from 10 s fits on
    # neither, so from 10 s to the end of the window (20 s) all of it is stuck.
    records = {
        "a": JobRecord("a", 0.0, 1.0, "n0", (_device("n0", 0, "1g.10gb", 6),), 101.0),
        "b": JobRecord("b", 0.0, 1.0, "n0", (_device("n0", 1, "1g.10gb", 6),), 101.0),
        "c": JobRecord("c", 10.0),
        "d": JobRecord("d", 20.0),
    }
    model = fleet_model(w.nodes)
    f = arm_figures("x", w, records, model, end=30.0, sample_s=1.0)
    assert f.frag == pytest.approx(0.5 * 7 / 8, abs=0.05)
    assert not list(model.holds()), "the model is given back empty"


def test_the_figures_model_names_devices_as_the_fleet_publishes_them() -> None:
    nodes = tuple(NodeSpec(f"n{i}", f.model, 2, 1000, 1024) for i, f in enumerate(INFERENCE.fleet))
    model = fleet_model(nodes)
    published = {
        (s["spec"]["pool"]["name"], d["name"])
        for s in fleet_slices(nodes)
        for d in s["spec"].get("devices") or ()
    }
    modelled = {
        (g.inventory.pool, d.name) for g in model.gpus.values() for d in g.inventory.devices
    }
    assert modelled == published


def test_arm_names() -> None:
    carve = parse_arm("carve")
    assert carve.carve and carve.name == f"carve-{DEFAULT_POLICY.value}"
    # Its own kube-scheduler binds what carve placed: the default profile, renamed.
    assert carve.profile == {"schedulerName": "bench-carve"}
    lw = parse_arm("carve-least-waste")
    assert lw.policy is Policy.LEAST_WASTE
    default = parse_arm("scheduler-default")
    assert default.profile == {"schedulerName": "bench-default"}, "the default, renamed"
    binpack = parse_arm("scheduler-binpack")
    assert not binpack.carve and binpack.scheduler == "bench-binpack"
    assert binpack.profile is not None
    [fit] = binpack.profile["pluginConfig"]
    assert fit["name"] == "NodeResourcesFit"
    assert fit["args"]["scoringStrategy"]["type"] == "MostAllocated"
    with pytest.raises(ValueError, match="one of carve, carve-best-fit"):
        parse_arm("carve-tightest")
    assert [a.name for a in parse_arms("carve, scheduler-binpack")] == [
        carve.name,
        "scheduler-binpack",
    ]
    with pytest.raises(ValueError, match="at most one carve arm"):
        parse_arms("carve-best-fit,carve-least-waste")


def test_the_in_process_replay_keeps_records_as_an_arm_does() -> None:
    from tests.bench.cluster_inprocess import replay

    timing = Timing(jobs=60, rate=2.0, load=1.5, min_run=5.0, max_run=60.0)
    w = mix_workload(INFERENCE, 2, timing, 4)
    end = w.last_arrival + 10.0
    records = replay(w, Policy.FILL_HOLES, end)
    assert set(records) == {j.name for j in w.jobs}
    bound = [r for r in records.values() if r.bound is not None]
    assert bound and len(bound) < len(records), "a loaded fleet: some wait past the end"
    lifetimes = {j.name: j.lifetime for j in w.jobs}
    for r in bound:
        assert r.bound is not None and r.created <= r.bound <= end
        assert r.devices and {d.pool for d in r.devices} == {r.node}
        if r.ended is not None:
            assert r.ended == pytest.approx(r.bound + lifetimes[r.name])
    f = arm_figures("carve-fill-holes-in-process", w, records, fleet_model(w.nodes), end)
    assert f.placed == len(bound) and not f.notes, "no device held twice"
    assert f.share > 0
