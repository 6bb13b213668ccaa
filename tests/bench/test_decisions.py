"""`python -m bench.decisions`'s machinery on one node, so it cannot rot. Only outcomes are
checked, never timings."""

from __future__ import annotations

from tests.support.decisions import report, run


def test_the_planner_places_every_pod_because_ended_pods_give_their_slices_back() -> None:
    # One node of 8 GPUs holds about 30 of these pods at once; 60 fit only if each ended
    # pod's claim is seen deallocated and its slice is free again.
    figures = run(nodes=1, decisions=60, live=10)
    assert (figures.decisions, figures.placed) == (60, 60)
    assert len(figures.wall_s) == len(figures.cpu_s) == 60
    text = report(figures)
    assert text.startswith("decisions: 60 on 1 nodes x 8 GPUs, 60 placed")
    assert "\nwall " in text and "\ncpu " in text


def test_without_releases_the_node_fills_and_pods_are_refused() -> None:
    figures = run(nodes=1, decisions=60, live=60)
    assert 0 < figures.placed < 60
