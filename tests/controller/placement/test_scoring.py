"""The packing policy is one interface with two implementations, chosen by `Policy`."""

from __future__ import annotations

from controller.model import FREE
from controller.placement import Policy
from controller.placement.scoring import (
    BestFit,
    CandidateTable,
    FirstFit,
    GpuValues,
    PackingPolicy,
    packing_policy,
)
from tests.support.cluster_builders import build_cluster
from tests.support.placement import A100


def test_policy_values_map_to_their_implementations() -> None:
    model = build_cluster(1, 1, [A100])
    assert isinstance(packing_policy(Policy.BEST_FIT, model), BestFit)
    assert isinstance(packing_policy(Policy.FIRST_FIT, model), FirstFit)


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
