"""The pure victim search (controller/preemption/search.py).

Two oracles: a toy one (each pod frees a weight, a node needs a total) checked against brute
force over many random cases, and the real one, the placement engine on its model with MIG
geometry, where the chosen set is also checked slice by slice against the GPU's geometry.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controller.objects import Kind, Plan, key_of
from controller.placement import NoPlacement, PlacementRequest
from controller.planner import EnginePlanner
from controller.preemption.search import (
    Candidate,
    SearchLimits,
    VictimSet,
    cheapest_victims,
    label_selector_matches,
    may_preempt,
    victim_cost,
)
from controller.status import build_allocation_status
from tests.support.engine_cluster import device_class, profile_claim, slices
from tests.support.reconciler import pod

# -- the toy oracle -----------------------------------------------------------------------------

_candidate = st.builds(
    lambda i, node, prio, run, w, b: (Candidate(f"ns/p{i}", node, prio, run, b), w),
    st.integers(0, 10**6),
    st.sampled_from(["n1", "n2"]),
    st.integers(-2, 6),
    st.floats(0, 1000, allow_nan=False),
    st.integers(1, 4),
    st.sampled_from([(), ("ns/pdb-a",), ("ns/pdb-b",)]),
)


def _brute_force(
    prio: int,
    cands: Sequence[Candidate],
    ok: object,
    allowances: dict[str, int],
) -> VictimSet | None:
    best: VictimSet | None = None
    eligible = [c for c in cands if c.priority < prio]
    for node in {c.node for c in eligible}:
        pool = [c for c in eligible if c.node == node]
        for size in range(1, len(pool) + 1):
            for combo in itertools.combinations(pool, size):
                taken: dict[str, int] = {}
                for c in combo:
                    for b in c.budgets:
                        taken[b] = taken.get(b, 0) + 1
                if any(n > allowances.get(b, n) for b, n in taken.items()):
                    continue
                if ok(node, frozenset(c.pod for c in combo)):  # type: ignore[operator]
                    vs = VictimSet(node, combo)
                    if best is None or vs.cost < best.cost:
                        best = vs
    return best


@given(
    st.lists(_candidate, max_size=9, unique_by=lambda cw: cw[0].pod),
    st.integers(0, 7),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 2),
)
@settings(max_examples=300, deadline=None)
def test_the_chosen_set_is_feasible_eligible_and_as_cheap_as_brute_force(
    cws: list[tuple[Candidate, int]], prio: int, need1: int, need2: int, allowed: int
) -> None:
    weight = {c.pod: w for c, w in cws}
    need = {"n1": need1, "n2": need2}
    calls: list[frozenset[str]] = []

    def ok(node: str, victims: frozenset[str]) -> bool:
        calls.append(victims)
        return sum(weight[v] for v in victims) >= need[node]

    cands = [c for c, _ in cws]
    allowances = {"ns/pdb-a": allowed}  # pdb-b: not observed yet, no limit here
    got = cheapest_victims(prio, cands, ok, allowances=allowances, limits=SearchLimits(9, 10**6))
    want = _brute_force(prio, cands, ok, allowances)
    assert not got.exhausted
    if want is None:
        assert got.chosen is None
        return
    assert got.chosen is not None
    assert got.chosen.cost == want.cost
    assert ok(got.chosen.node, frozenset(got.chosen.pods))
    assert all(v.priority < prio for v in got.chosen.victims)
    assert len({v.node for v in got.chosen.victims}) == 1
    assert sum(1 for v in got.chosen.victims if "ns/pdb-a" in v.budgets) <= allowed
    # No victim is there for nothing: without any one of them the pod would not fit.
    for v in got.chosen.victims:
        assert not ok(got.chosen.node, frozenset(got.chosen.pods) - {v.pod})


def test_fewer_victims_beat_lower_priority_then_priority_then_work_lost() -> None:
    a = Candidate("ns/a", "n", 1, 10.0)
    b = Candidate("ns/b", "n", 1, 10.0)
    big = Candidate("ns/big", "n", 5, 10.0)
    assert victim_cost("n", [big]) < victim_cost("n", [a, b])
    young = Candidate("ns/young", "n", 1, 5.0)
    assert victim_cost("n", [young]) < victim_cost("n", [a])
    assert victim_cost("n", [Candidate("ns/x", "n", 0, 900.0)]) < victim_cost("n", [a])


def test_equal_and_higher_priority_pods_are_never_chosen() -> None:
    cands = [Candidate("ns/eq", "n", 5), Candidate("ns/hi", "n", 9)]
    got = cheapest_victims(5, cands, lambda _n, _v: True)
    assert got.chosen is None
    assert got.checks == 0


def test_the_check_budget_stops_the_search_and_says_so() -> None:
    cands = [Candidate(f"ns/p{i}", "n", 0) for i in range(10)]
    got = cheapest_victims(
        1, cands, lambda _n, v: len(v) >= 5, limits=SearchLimits(max_victims=8, max_checks=50)
    )
    assert got.exhausted
    assert got.checks == 50


def test_preemption_policy_never() -> None:
    assert not may_preempt({"preemptionPolicy": "Never"})
    assert may_preempt({"preemptionPolicy": "PreemptLowerPriority"})
    assert may_preempt({})


@pytest.mark.parametrize(
    ("selector", "labels", "want"),
    [
        (None, {"a": "1"}, False),
        ({}, {"a": "1"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "2"}}, {"a": "1"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {"a": "1"}, True),
        (
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
            {"a": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
    ],
)
def test_pdb_selectors(
    selector: dict[str, object] | None, labels: dict[str, str], want: bool
) -> None:
    assert label_selector_matches(selector, labels) is want


# -- the real oracle: the placement engine on its model -----------------------------------------

DRIVER = "mig.carve.dev"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
A100_PROFILES = ["1g.5gb", "1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb", "1g.10gb"]


def _filled(seed: int, gpus: int) -> tuple[EnginePlanner, list[Candidate], dict[str, str]]:
    """One node of A100-40GB GPUs filled by the engine itself with random small profiles at
    random priorities; returns the planner, the candidates and pod -> claim key."""
    rng = random.Random(seed)
    planner = EnginePlanner(DRIVER)
    classes = {c["metadata"]["name"]: c for c in (device_class(DRIVER, "mig"),)}
    planner.observe(Kind.CLASS, classes[DRIVER])
    for s in slices("n1", ["A100-SXM4-40GB"] * gpus):
        planner.observe(Kind.SLICE, s)
    cands: list[Candidate] = []
    claim_of: dict[str, str] = {}
    for i in range(7 * gpus):
        c = profile_claim(f"c{i}", rng.choice(A100_PROFILES))
        p = pod(f"v{i}", [f"c{i}"])
        verdict = planner.plan(p, [c], classes)
        if not isinstance(verdict, Plan):
            continue
        c["status"]["allocation"] = build_allocation_status(c, verdict.allocations[0], classes, NOW)
        planner.observe(Kind.CLAIM, c)
        cands.append(Candidate(key_of(p), "n1", rng.randint(0, 4), rng.uniform(0, 600)))
        claim_of[key_of(p)] = key_of(c)
    return planner, cands, claim_of


@given(st.integers(0, 10**6), st.sampled_from(["4g.20gb", "3g.20gb", "7g.40gb", "2g.10gb"]))
@settings(max_examples=40, deadline=None)
def test_on_the_engine_the_chosen_slices_combine_and_no_cheaper_set_exists(
    seed: int, profile: str
) -> None:
    planner, cands, claim_of = _filled(seed, gpus=1)
    preemptor = pod("hi", ["want"], priority=3)
    want = profile_claim("want", profile)
    request = planner.placement_request(preemptor, [want])
    assert isinstance(request, PlacementRequest)
    assume(isinstance(planner.engine.place(request), NoPlacement))

    def ok(node: str, victims: frozenset[str]) -> bool:
        freed = [claim_of[v] for v in victims]
        return planner.placement_without(request, node, freed, victims) is not None

    got = cheapest_victims(3, cands, ok, limits=SearchLimits(8, 10**6))
    brute = _brute_force(3, cands, ok, {})
    assert (got.chosen is None) == (brute is None)
    if got.chosen is None or brute is None:
        return
    assert got.chosen.cost == brute.cost
    assert all(v.priority < 3 for v in got.chosen.victims)
    # Independently of the oracle: the pod's instance plus what the others keep is a valid
    # MIG state of that GPU (the geometry refuses overlaps and impossible starts).
    placement = planner.placement_without(
        request,
        "n1",
        [claim_of[v] for v in got.chosen.pods],
        got.chosen.pods,
    )
    assert placement is not None
    (choice,) = placement.choices
    kept = set(claim_of.values()) - {claim_of[v] for v in got.chosen.pods}
    record = planner.model.gpus[choice.gpu_uuid]
    instances = [(choice.profile_id, choice.start)]
    for hold in planner.model.holds():
        if f"{hold.claim.namespace}/{hold.claim.name}" in kept:
            for d in hold.devices:
                hit = planner.model.device(d.pool, d.device)
                assert hit is not None
                if hit[0].uuid == choice.gpu_uuid:
                    instances.append((hit[1].profile_id, hit[1].start))
    record.geometry.state_of(instances)
    # The what-if left the model as it was: the pod still fits nowhere.
    assert isinstance(planner.engine.place(request), NoPlacement)
