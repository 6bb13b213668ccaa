"""The packing policy is one interface with several implementations, chosen by `Policy`."""

from __future__ import annotations

import pytest

from controller.claims import ClaimHold, ClaimKey
from controller.model import FREE
from controller.nodefit import PodNeeds, Resources
from controller.placement import Placement, PlacementEngine, PlacementRequest, Policy
from controller.placement.scoring import (
    BestFit,
    CandidateTable,
    FillHoles,
    FirstFit,
    GpuValues,
    LeastWaste,
    PackingPolicy,
    packing_policy,
)
from driver.allocation import AllocatedDevice
from tests.support.cluster_builders import CLASSES, DRIVER, build_cluster, profile_claim
from tests.support.placement import A100, H100


def test_policy_values_map_to_their_implementations() -> None:
    model = build_cluster(1, 1, [A100])
    assert isinstance(packing_policy(Policy.BEST_FIT, model), BestFit)
    assert isinstance(packing_policy(Policy.FIRST_FIT, model), FirstFit)
    assert type(packing_policy(Policy.LEAST_WASTE, model)) is LeastWaste
    assert isinstance(packing_policy(Policy.FILL_HOLES, model), FillHoles)


def test_on_an_empty_a100_best_fit_keeps_the_big_placements_and_first_fit_takes_nvml_order() -> (
    None
):
    model = build_cluster(1, 1, [A100])
    (gpu,) = model.gpus.values()
    one_g = next(p for p in A100.profiles if p.name == "1g.10gb")
    eligible = frozenset((one_g.id, p.start) for p in one_g.placements)

    def first(policy: PackingPolicy) -> int:
        return CandidateTable(policy, GpuValues()).candidates(gpu, FREE, eligible)[0].start

    assert first(BestFit(model)) == 6  # leaves 0-3 and 4-5 whole
    assert first(FirstFit()) == one_g.placements[0].start


def _busy_h100_idle_a100():
    """node-0000: two H100s, one holding six 1g (the 1g placement at 6 free), one a 7g:
    H100s are 14/16 used. node-0001: two empty A100-80GBs. Both offer a 1g.10gb."""
    model = build_cluster(2, 2, [H100, A100])
    one_g = next(p for p in H100.profiles if p.name == "1g.10gb")
    seven_g = next(p for p in H100.profiles if p.name == "7g.80gb")
    split, whole = sorted(u for u, g in model.gpus.items() if g.node == "node-0000")
    held = [(split, one_g.id, pl.start) for pl in one_g.placements if pl.start != 6]
    held.append((whole, seven_g.id, 0))
    for n, (uuid, pid, start) in enumerate(held):
        record = model.gpus[uuid]
        device = record.by_placement[(pid, start)].name
        key = ClaimKey("fill", f"f{n}", f"f{n}")
        hold = (AllocatedDevice("gpu", DRIVER, record.inventory.pool, device),)
        model.hold(ClaimHold(key, record.node, hold))
    return model, split


@pytest.mark.parametrize(
    ("policy", "fills_the_hole"),
    [(Policy.FILL_HOLES, True), (Policy.BEST_FIT, False), (Policy.LEAST_WASTE, False)],
)
def test_fill_holes_puts_a_slice_in_a_busy_models_hole_before_splitting_an_idle_gpu(
    policy: Policy, fills_the_hole: bool
) -> None:
    model, split = _busy_h100_idle_a100()
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
    request = PlacementRequest(
        "p/new", PodNeeds(Resources(1000, 2**30, 1)), (profile_claim("new", "1g.10gb"),)
    )
    result = engine.place(request)
    assert isinstance(result, Placement)
    (choice,) = result.choices
    # The hole wastes as much as a 1g on an empty GPU (two memory slices each: its own and
    # one no further 1g can use), so least waste's tolerance keeps both; then the band (best
    # fit, least waste) sends the slice to the idle A100s, splitting one, while fill holes
    # takes the smaller loss: the hole.
    assert (choice.gpu_uuid == split) is fills_the_hole
    if fills_the_hole:
        assert choice.start == 6
    if not fills_the_hole:
        assert choice.node == "node-0001"
