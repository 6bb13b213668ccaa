"""A tiny stretch of a trace through the real control plane, both ways (bench/trace_e2e.py):
carve-controller and kube-scheduler's native path each run every job, a job that does not fit
waits until an earlier one ends, and the queueing delay is measured from the pods' binding."""

from __future__ import annotations

import pytest

from nodesim.stack import CarveStack
from tests.bench.alibaba import TraceNode, TraceTask
from tests.bench.through_cluster import Shortening, native_classes, run_path, shorten
from tests.e2e.harness import E2E, GATED_NAMESPACES

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODE = TraceNode("trace-0", 16000, 65536, 2, "G2")  # two H100s


def _tasks() -> list[TraceTask]:
    def task(name: str, gpus: int, milli: int, start: int) -> TraceTask:
        return TraceTask(name, 1000, 1024, gpus, milli, (), start, start + 10)

    return [
        task("a", 1, 1000, 0),
        task("b", 1, 1000, 1),
        task("c", 1, 1000, 2),  # both GPUs are taken: waits for a
        task("d", 1, 460, 3),  # a 4g: waits for b
        task("e", 2, 1000, 4),  # both GPUs: waits for c and d
    ]


@pytest.mark.parametrize("native", [False, True], ids=["carve", "native"])
def test_a_shortened_trace_runs_to_the_end_and_jobs_wait_their_turn(
    carve: CarveStack, request: pytest.FixtureRequest, native: bool
) -> None:
    how = Shortening(jobs=5, span=4.0, median_run=5.0, min_run=5.0, max_run=5.0, offset=0.0)
    jobs, _ = shorten(_tasks(), [NODE], how)
    native_classes(carve)
    env = E2E(carve, request.node.name, {} if native else GATED_NAMESPACES)
    try:
        figures = run_path(carve, [NODE], jobs, native=native, env=env, grace=60.0)
    finally:
        problems = env.teardown()
    assert problems == []
    assert (figures.bound, figures.finished) == (5, 5), figures.notes
    assert "failed" not in figures.notes and "invariant" not in figures.notes, figures.notes
    # e (both GPUs, arriving at 4 s) cannot start before c (started when a ended, at 5 s or
    # later) has run its 5 s: it waits 6 s or more.
    assert figures.wait_p99 >= 6.0
    assert figures.placed < 5  # and so it is not placed by the last arrival
