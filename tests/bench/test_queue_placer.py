"""Joint placement of the pending queue (tests/bench/queue_placer.py): it never places less of
the window than serving it in queue order, never gives a device twice, leaves the model as it
found it, and keeps a node for a pod that has waited too long."""

from __future__ import annotations

import contextlib
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.claims import ClaimHold, ClaimKey
from controller.model import ClusterModel
from controller.nodefit import PodNeeds, Resources
from controller.placement import Placement, PlacementEngine, PlacementRequest, Policy
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from tests.bench.queue_placer import QueuePlacer, Waiting
from tests.support.cluster_builders import CLASSES, DRIVER, build_cluster, profile_claim

H100 = gpu_model("H100-SXM5-80GB")
A30 = gpu_model("A30-24GB")
NEEDS = PodNeeds(Resources(1000, 2**30, 1))
_SIZE = {p.name: p.size for m in (H100, A30) for p in m.profiles}


def _waiting(pod: str, profile: str, since: float = 0.0) -> Waiting:
    model = H100 if profile in {p.name for p in H100.profiles} else A30
    weight = _SIZE[profile] / model.memory_units
    request = PlacementRequest(f"q/{pod}", NEEDS, (profile_claim(pod, profile),))
    return Waiting(request, since, weight)


def _fill(model: ClusterModel, node: str, profile: str, name: str) -> ClaimKey:
    """Hold one slice of ``profile`` on the node's first GPU that takes it."""
    for record in model.gpus_on(node):
        spec = next(p for p in record.inventory.model.profiles if p.name == profile)
        starts = record.geometry.feasible_starts(record.occupancy.state, spec.id)
        if starts:
            device = record.by_placement[(spec.id, starts[0])].name
            key = ClaimKey("fill", name, name)
            pool = record.inventory.pool
            model.hold(ClaimHold(key, node, (AllocatedDevice("gpu", DRIVER, pool, device),)))
            return key
    raise AssertionError(f"no room for {profile} on {node}")


def _commit(engine: PlacementEngine, pod: str, placement: Placement) -> None:
    engine.commit(placement, pod, NEEDS)


def test_a_heavier_pod_behind_a_lighter_one_gets_the_freed_gpu() -> None:
    model = build_cluster(1, 1, [H100])
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=Policy.LEAST_WASTE)
    queue = [_waiting("half", "4g.40gb"), _waiting("whole", "7g.80gb")]

    plan = QueuePlacer(engine).plan(queue, now=0.0)

    assert [pod for pod, _ in plan.placements] == ["q/whole"]
    assert plan.queue_order_weight == 0.5  # queue order: the 4g takes the GPU, the 7g waits
    assert plan.weight == 1.0
    assert plan.orders_tried >= 2


def test_the_queue_order_wins_ties() -> None:
    model = build_cluster(1, 1, [H100])
    engine = PlacementEngine(model, CLASSES, DRIVER)
    queue = [_waiting("first", "4g.40gb"), _waiting("second", "4g.40gb")]

    plan = QueuePlacer(engine).plan(queue, now=0.0)

    assert [pod for pod, _ in plan.placements] == ["q/first"]


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[int, list[tuple[str, float]]]:
    seed = draw(st.integers(0, 10_000))
    profiles = sorted(p.name for m in (H100, A30) for p in m.profiles if "+" not in p.name)
    queue = draw(
        st.lists(
            st.tuples(st.sampled_from(profiles), st.floats(0, 100, allow_nan=False)),
            min_size=1,
            max_size=7,
        )
    )
    return seed, queue


def _random_cluster(seed: int) -> ClusterModel:
    model = build_cluster(3, 2, [H100, A30])
    rng = random.Random(seed)
    for n, node in enumerate(sorted(model.gpu_nodes())):
        for k in range(rng.randrange(4)):
            profile = rng.choice(
                [p.name for p in model.gpus_on(node)[0].inventory.model.profiles][:4]
            )
            with contextlib.suppress(AssertionError):
                _fill(model, node, profile, f"f{n}-{k}")
    return model


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenarios(), st.booleans())
def test_joint_places_at_least_the_queue_orders_weight_and_never_double_books(
    scenario: tuple[int, list[tuple[str, float]]], keep: bool
) -> None:
    seed, entries = scenario
    queue = [_waiting(f"p{i}", profile, since) for i, (profile, since) in enumerate(entries)]

    greedy_model = _random_cluster(seed)
    greedy = PlacementEngine(greedy_model, CLASSES, DRIVER, policy=Policy.LEAST_WASTE)
    greedy_weight = 0.0
    for w in queue:
        result = greedy.place(w.request)
        if isinstance(result, Placement):
            _commit(greedy, w.request.pod, result)
            greedy_weight += w.weight

    model = _random_cluster(seed)
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=Policy.LEAST_WASTE)
    before = model.snapshot()
    placer = QueuePlacer(engine, keep_after=50.0 if keep else None, budget_s=10.0)
    plan = placer.plan(queue, now=100.0)

    assert model.snapshot() == before  # the plan is only an answer
    if not keep:
        assert plan.queue_order_weight == greedy_weight
        assert plan.weight >= greedy_weight - 1e-9
    weights = {w.request.pod: w.weight for w in queue}
    assert abs(sum(weights[pod] for pod, _ in plan.placements) - plan.weight) < 1e-9
    pods = [pod for pod, _ in plan.placements]
    assert len(pods) == len(set(pods))
    devices = [(c.pool, c.device) for _, p in plan.placements for c in p.choices]
    assert len(devices) == len(set(devices))
    for pod, placement in plan.placements:  # written in order, the plan holds together
        _commit(engine, pod, placement)
    assert not model.problems


def test_a_starving_pod_gets_a_node_kept_that_others_may_not_take() -> None:
    model = build_cluster(2, 1, [H100])
    fillers = {node: _fill(model, node, "1g.10gb", f"fill-{node}") for node in model.gpu_nodes()}
    engine = PlacementEngine(model, CLASSES, DRIVER)
    big = _waiting("big", "7g.80gb", since=0.0)
    small = _waiting("small", "1g.10gb", since=95.0)

    unguarded = QueuePlacer(engine).place_one(small)
    assert isinstance(unguarded, Placement) and unguarded.node == "node-0000"

    placer = QueuePlacer(engine, keep_after=60.0)
    plan = placer.plan([big, small], now=100.0)
    assert plan.kept == {"q/big": "node-0000"}
    assert [(pod, p.node) for pod, p in plan.placements] == [("q/small", "node-0001")]
    for pod, placement in plan.placements:
        _commit(engine, pod, placement)

    model.release(fillers["node-0000"])  # the kept node drains: the starving pod goes there
    plan = placer.plan([big], now=110.0)
    assert [(pod, p.node) for pod, p in plan.placements] == [("q/big", "node-0000")]
    assert plan.kept == {}


def test_a_pod_that_fits_no_empty_node_keeps_nothing() -> None:
    model = build_cluster(1, 1, [A30])
    engine = PlacementEngine(model, CLASSES, DRIVER)
    placer = QueuePlacer(engine, keep_after=1.0)

    plan = placer.plan([_waiting("huge", "7g.80gb", since=0.0)], now=100.0)

    assert plan.kept == {}
    assert plan.placements == ()
    assert isinstance(placer.place_one(_waiting("one", "1g.6gb")), Placement)
