"""The queued replay (tests/bench/queued.py): jobs wait, are retried when capacity frees, and
their queueing delay is measured in trace time; carve's joint placement and starvation guard
run on the same queue as kube-scheduler's allocator."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.placement.scoring import Policy
from tests.bench.alibaba import (
    NODE_FILE,
    TRACE_DIR,
    TRACE_REQUIRED,
    TraceNode,
    TraceTask,
    load_nodes,
    load_tasks,
)
from tests.bench.queued import in_order, joint, percentile, replay_queued
from tests.bench.replay import build_jobs, build_model, carve, real, select_nodes
from tests.support.real_allocator import CachedAllocator

NODE = TraceNode("n0", 32000, 262144, 2, "G2")  # two H100s


def _task(name: str, gpus: int, milli: int, start: int, end: int) -> TraceTask:
    return TraceTask(name, 1000, 1024, gpus, milli, (), start, end)


def _jobs() -> list:  # type: ignore[type-arg]
    tasks = [
        _task("a", 1, 1000, 0, 100),  # a whole GPU for 100 s
        _task("b", 1, 1000, 10, 60),  # the other GPU for 50 s
        _task("c", 2, 1000, 20, 50),  # both GPUs: waits until a and b are gone (t=100)
        _task("d", 1, 460, 30, 40),  # a 4g: waits for b (t=60), behind c, which cannot go
    ]
    return build_jobs(tasks, [NODE], mode="timeline")


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile(list(range(1, 101)), 0.99) == 99


@pytest.mark.parametrize(
    "service",
    [in_order(carve(Policy.LEAST_WASTE)), joint(Policy.LEAST_WASTE, window=4)],
    ids=["in-order", "joint"],
)
def test_jobs_wait_for_departures_and_their_delay_is_trace_time(service: object) -> None:
    jobs = _jobs()
    figures = replay_queued(build_model([NODE]), jobs, service)  # type: ignore[arg-type]

    # a starts at 0, b at 10; d gets b's GPU at 60 (wait 30); c gets both at 100 (wait 80).
    assert figures.jobs == 4
    assert figures.placed == 2  # by the last arrival (t=30): a and b
    assert figures.waited == 2
    assert figures.never == 0
    assert sorted([figures.wait_p50, figures.wait_p99]) == [0, 80]
    assert figures.large_wait_max == 80


def test_the_starvation_guard_keeps_room_for_the_waiting_multi_gpu_job() -> None:
    tasks = [
        _task("a", 1, 1000, 0, 100),
        _task("b", 1, 1000, 0, 60),
        _task("big", 2, 1000, 5, 105),  # needs both GPUs
        # small jobs keep arriving and take whichever GPU frees first
        *[_task(f"s{i}", 1, 1000, 50 + 10 * i, 50 + 10 * i + 80) for i in range(6)],
    ]
    jobs = build_jobs(tasks, [NODE], mode="timeline")
    plain = replay_queued(build_model([NODE]), jobs, joint(Policy.LEAST_WASTE))
    guarded = replay_queued(build_model([NODE]), jobs, joint(Policy.LEAST_WASTE, keep_after=30))

    assert guarded.large_wait_max < plain.large_wait_max
    assert guarded.never == plain.never == 0


def test_the_allocator_serves_the_same_queue(dra_allocate: Path) -> None:
    jobs = _jobs()
    figures = replay_queued(
        build_model([NODE]), jobs, in_order(real(CachedAllocator(dra_allocate)))
    )
    assert (figures.placed, figures.waited, figures.never) == (2, 2, 0)
    assert figures.large_wait_max == 80


needs_trace = pytest.mark.skipif(
    not (TRACE_DIR / NODE_FILE).exists() and not TRACE_REQUIRED,
    reason=f"trace not found in {TRACE_DIR} (set CARVE_TRACE_DIR)",
)


@needs_trace
def test_joint_placement_places_at_least_what_queue_order_places_on_a_trace_slice() -> None:
    nodes = select_nodes(load_nodes(TRACE_DIR / NODE_FILE), 12)
    tasks = load_tasks(TRACE_DIR / "openb_pod_list_default.csv")
    jobs = build_jobs(tasks, nodes, mode="timeline", speedup=60, limit=300)
    ordered = replay_queued(build_model(nodes), jobs, in_order(carve(Policy.LEAST_WASTE)))
    together = replay_queued(build_model(nodes), jobs, joint(Policy.LEAST_WASTE))
    assert ordered.waited > 0  # the slice is loaded enough for a queue to form
    assert together.never == ordered.never
    assert together.jobs == ordered.jobs == len(jobs)
