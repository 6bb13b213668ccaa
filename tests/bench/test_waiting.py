"""`python -m bench.waiting`'s machinery on one node, so it cannot rot. Only outcomes are
checked, never timings."""

from __future__ import annotations

from tests.support.waiting import report, run


def test_ends_place_waiting_pods_with_and_without_shared_refusals() -> None:
    off = run(nodes=1, queued=60, ends=5, shared_refusal_s=0.0, label="off")
    on = run(nodes=1, queued=60, ends=5, shared_refusal_s=1.0, label="on")
    assert off.waiting == on.waiting > 0, "one node of 8 GPUs cannot hold 60 of these pods"
    assert off.ends == on.ends == 5
    assert off.placed_after_ends == on.placed_after_ends > 0, "freed slices were used"
    assert off.searches > on.searches > 0
    text = report([off, on])
    assert text.splitlines()[1].startswith("off") and text.splitlines()[2].startswith("on")
