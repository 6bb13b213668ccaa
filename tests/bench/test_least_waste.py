"""The least-waste policy (controller/placement/scoring.py), chosen by the trace benchmark, and
fill holes, least waste with loss before the model band: they only reorder what best fit may
choose, so it never places where geometry forbids, places
exactly when best fit does, decides deterministically, and never takes a candidate that wastes
more than the tolerance beyond the least wasteful one."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.claims import ClaimHold, ClaimKey
from controller.model import ClusterModel
from controller.nodefit import PodNeeds, Resources
from controller.placement import NoPlacement, Placement, PlacementEngine, PlacementRequest
from controller.placement.scoring import (
    WASTE_TOLERANCE,
    CandidateTable,
    GpuValues,
    LeastWaste,
    Policy,
)
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from tests.support.cluster_builders import CLASSES, DRIVER, build_cluster, profile_claim

MODELS = [gpu_model(k) for k in ("A30-24GB", "A100-SXM4-40GB", "H100-SXM5-80GB")]
PROFILES = sorted({p.name for m in MODELS for p in m.profiles if "+" not in p.name})
NEEDS = PodNeeds(Resources(1000, 2**30, 1))


def _cluster(seed: int, nodes: int, fill: float) -> ClusterModel:
    """``nodes`` nodes of two GPUs each (models in turn), randomly split up to ``fill``."""
    model = build_cluster(nodes, 2, MODELS)
    rng = random.Random(seed)
    for n, uuid in enumerate(sorted(model.gpus)):
        record = model.gpus[uuid]
        state = record.occupancy.state
        for k in range(8):
            if state.occupied.bit_count() >= fill * record.inventory.model.memory_units:
                break
            spec = rng.choice(record.inventory.model.profiles)
            starts = record.geometry.feasible_starts(state, spec.id)
            if not starts:
                continue
            start = rng.choice(starts)
            state = record.geometry.place(state, spec.id, start)
            device = record.by_placement[(spec.id, start)].name
            key = ClaimKey("fill", f"f-{n}-{k}", f"f-{n}-{k}")
            pool = record.inventory.pool
            model.hold(ClaimHold(key, record.node, (AllocatedDevice("gpu", DRIVER, pool, device),)))
    return model


def _place(model: ClusterModel, policy: Policy, profile: str) -> Placement | NoPlacement:
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
    request = PlacementRequest("p/new", NEEDS, (profile_claim("new", profile),))
    return engine.place(request)


cases = given(
    seed=st.integers(0, 10_000),
    nodes=st.integers(1, 4),
    fill=st.floats(0.0, 1.0),
    profile=st.sampled_from(PROFILES),
)


POLICIES = pytest.mark.parametrize("policy", [Policy.LEAST_WASTE, Policy.FILL_HOLES])


@POLICIES
@cases
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_it_places_where_geometry_allows_exactly_when_best_fit_places(
    policy: Policy, seed: int, nodes: int, fill: float, profile: str
) -> None:
    ours = _place(_cluster(seed, nodes, fill), policy, profile)
    best = _place(_cluster(seed, nodes, fill), Policy.BEST_FIT, profile)
    assert isinstance(ours, Placement) == isinstance(best, Placement)
    if isinstance(ours, Placement):
        model = _cluster(seed, nodes, fill)
        (choice,) = ours.choices
        record = model.gpus[choice.gpu_uuid]
        assert record.geometry.fits(record.occupancy.state, choice.profile_id, choice.start)
        assert choice.profile == profile
        PlacementEngine(model, CLASSES, DRIVER).commit(ours, "p/new", NEEDS)
        assert not model.problems


@POLICIES
@cases
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_it_is_deterministic_and_stays_within_the_waste_tolerance(
    policy: Policy, seed: int, nodes: int, fill: float, profile: str
) -> None:
    first = _place(_cluster(seed, nodes, fill), policy, profile)
    again = _place(_cluster(seed, nodes, fill), policy, profile)
    assert first == again
    if not isinstance(first, Placement):
        return
    model = _cluster(seed, nodes, fill)
    policy = LeastWaste(model)
    table = CandidateTable(policy, GpuValues())
    wastes = []
    chosen = None
    (choice,) = first.choices
    for record in model.gpus.values():
        spec = next((p for p in record.inventory.model.profiles if p.name == profile), None)
        if spec is None:
            continue
        eligible = frozenset((spec.id, pl.start) for pl in spec.placements)
        candidates = table.candidates(record, record.occupancy, eligible)
        if not candidates:
            continue
        best = candidates[0]  # the placement best fit would take on this GPU
        wastes.append(policy.waste(record.geometry, best.after, best.profile_id))
        if record.uuid == choice.gpu_uuid:
            chosen = policy.waste(record.geometry, best.after, best.profile_id)
            assert (best.profile_id, best.start) == (choice.profile_id, choice.start)
    assert chosen is not None
    assert chosen <= min(wastes) + WASTE_TOLERANCE
