from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.claims import (
    AllocationMode,
    Alternative,
    ConstraintKind,
    DeviceClass,
    DeviceConstraint,
    DeviceRequest,
    ExactRequest,
)
from controller.model import WHOLE_GPU, ClusterModel
from controller.nodefit import NodeInfo, PodNeeds, Resources, Taint, TaintEffect, check_node
from controller.placement import (
    NoPlacement,
    NoPlacementReason,
    Placement,
    PlacementEngine,
    PlacementRequest,
    Policy,
)
from controller.tolerations import Toleration
from driver.geometry import geometry_for
from tests.support.cluster_builders import (
    CLASSES,
    build_cluster,
    build_gpu,
    node_info,
    profile_claim,
)
from tests.support.placement import (
    A100,
    A100_40,
    H100,
    NEEDS,
    PROFILE,
    claim,
    engine_for,
    exact,
    first_available,
    place,
    placed,
)


def replay(model: ClusterModel) -> None:
    """Invariant 1: rebuild every GPU's state from the holds alone, through the geometry."""
    used: Counter[tuple[str, str]] = Counter()
    per_gpu: dict[str, list[tuple[int, int]]] = {}
    for hold in model.holds():
        for d in hold.devices:
            used[(d.pool, d.device)] += 1
            hit = model.device(d.pool, d.device)
            assert hit is not None
            gpu, dev = hit
            per_gpu.setdefault(gpu.uuid, []).append((dev.profile_id, dev.start))
    assert all(n == 1 for n in used.values()), "a device was allocated twice"
    for uuid, instances in per_gpu.items():
        if any(pid == WHOLE_GPU for pid, _ in instances):
            assert len(instances) == 1
            continue
        geometry_for(model.gpus[uuid].inventory.model).state_of(instances)  # raises on overlap


def test_single_slice_gets_a_real_device_of_the_requested_profile() -> None:
    model = build_cluster(2, 2, [A100])
    result = placed(place(engine_for(model), "p", profile_claim("c", "3g.40gb")))
    (choice,) = result.choices
    assert choice.profile == "3g.40gb"
    gpu, device = model.device(choice.pool, choice.device)  # type: ignore[misc]
    assert device.profile_id == 9 and device.start == choice.start
    assert gpu.uuid == choice.gpu_uuid and gpu.node == result.node == choice.node


def test_best_fit_packs_small_slices_onto_a_gpu_already_in_use() -> None:
    model = build_cluster(2, 2, [A100])
    engine = engine_for(model)
    first = placed(place(engine, "a", profile_claim("a", "1g.10gb")))
    engine.commit(first, "a", NEEDS)
    second = placed(place(engine, "b", profile_claim("b", "1g.10gb")))
    assert second.choices[0].gpu_uuid == first.choices[0].gpu_uuid
    assert second.loss < first.loss


def test_best_fit_keeps_room_that_first_fit_fragments() -> None:
    # Same sequence for both policies; first fit scatters 1g slices from start 0 and leaves
    # holes no 2g.20gb can use, best fit fills from the end and keeps one 2g placement free.
    def run(policy: Policy) -> tuple[int, int]:
        model = build_cluster(1, 2, [A100])
        engine = engine_for(model, policy)
        for i, profile in enumerate(["1g.10gb", "1g.10gb", "2g.20gb", "1g.10gb"]):
            engine.commit(
                placed(place(engine, f"p{i}", profile_claim(f"c{i}", profile))), f"p{i}", NEEDS
            )
        geometry = geometry_for(A100)
        two_g = sum(geometry.remaining_capacity(g.occupancy.state, 14) for g in model.gpus.values())
        used_gpus = sum(1 for g in model.gpus.values() if g.occupancy.in_use)
        return two_g, used_gpus

    best, first = run(Policy.BEST_FIT), run(Policy.FIRST_FIT)
    assert best[1] == first[1] == 1  # both pack onto one GPU
    assert best[0] == 3 + 1 and first[0] == 3 + 0


def test_place_is_pure_and_all_or_nothing() -> None:
    model = build_cluster(1, 1, [A100])
    engine = engine_for(model)
    before = model.snapshot()
    # Two claims: 4g.40gb fits, but 4g + 7g cannot share one GPU.
    result = place(
        engine, "p", claim("a", exact("r", "4g.40gb")), claim("b", exact("r", "7g.80gb"))
    )
    assert isinstance(result, NoPlacement)
    assert result.reason is NoPlacementReason.INSUFFICIENT_DEVICES
    assert model.snapshot() == before
    assert not list(model.holds())


def test_several_claims_and_counts_land_on_one_node() -> None:
    model = build_cluster(3, 2, [A100])
    engine = engine_for(model)
    result = placed(
        place(
            engine,
            "p",
            claim("a", exact("r", "3g.40gb", count=3)),
            claim("b", exact("s", "1g.10gb")),
        )
    )
    assert len(result.choices) == 4
    assert {c.node for c in result.choices} == {result.node}
    assert Counter(c.claim.name for c in result.choices) == {"a": 3, "b": 1}
    engine.commit(result, "p", NEEDS)
    replay(model)


def test_match_attribute_parent_uuid_keeps_slices_on_one_gpu() -> None:
    model = build_cluster(1, 4, [A100])
    engine = engine_for(model)
    same = DeviceConstraint((), ConstraintKind.MATCH, "mig.carve.dev/parentUUID")
    result = placed(
        place(engine, "p", claim("a", exact("r", "2g.20gb", count=3), constraints=[same]))
    )
    assert len({c.gpu_uuid for c in result.choices}) == 1
    # Four 2g.20gb never fit on one A100 (three placements exist), so the constraint refuses.
    refused = place(engine, "q", claim("b", exact("r", "2g.20gb", count=4), constraints=[same]))
    assert isinstance(refused, NoPlacement)


def test_distinct_attribute_spreads_slices_over_gpus() -> None:
    model = build_cluster(1, 4, [A100])
    engine = engine_for(model)
    apart = DeviceConstraint(("r",), ConstraintKind.DISTINCT, "mig.carve.dev/parentUUID")
    result = placed(
        place(engine, "p", claim("a", exact("r", "1g.10gb", count=4), constraints=[apart]))
    )
    assert len({c.gpu_uuid for c in result.choices}) == 4
    refused = place(engine, "q", claim("b", exact("r", "1g.10gb", count=5), constraints=[apart]))
    assert isinstance(refused, NoPlacement)


def test_match_attribute_across_requests_of_a_claim() -> None:
    model = build_cluster(1, 3, [A100])
    engine = engine_for(model)
    same = DeviceConstraint(("big", "small"), ConstraintKind.MATCH, "mig.carve.dev/parentUUID")
    result = placed(
        place(
            engine,
            "p",
            claim("a", exact("big", "4g.40gb"), exact("small", "2g.20gb"), constraints=[same]),
        )
    )
    assert len({c.gpu_uuid for c in result.choices}) == 1


def test_first_available_prefers_the_first_subrequest_that_fits() -> None:
    model = build_cluster(1, 1, [A100])
    engine = engine_for(model)
    first = placed(place(engine, "a", claim("a", first_available("4g.40gb", "1g.10gb"))))
    assert first.choices[0].request == "gpu/4g-40gb"
    engine.commit(first, "a", NEEDS)
    # 4g.40gb no longer fits on the only GPU; 3g.40gb does (placement 4) and comes first.
    second = placed(
        place(engine, "b", claim("b", first_available("4g.40gb", "3g.40gb", "1g.10gb")))
    )
    assert second.choices[0].request == "gpu/3g-40gb"
    engine.commit(second, "b", NEEDS)
    # The GPU is now full (4g at 0-3, 3g at 4-7): no alternative fits, all are explained.
    third = place(engine, "c", claim("c", first_available("7g.80gb", "1g.10gb")))
    assert isinstance(third, NoPlacement)
    assert "7g.80gb" in third.message and "1g.10gb" in third.message
    replay(model)


def test_allocation_mode_all_takes_every_matching_device_on_one_node() -> None:
    model = build_cluster(2, 3, [A100])
    engine = engine_for(model)
    request = DeviceRequest(
        "all",
        (Alternative("all", ExactRequest("gpu.carve.dev", mode=AllocationMode.ALL, count=0)),),
    )
    result = placed(place(engine, "p", claim("a", request)))
    assert len(result.choices) == 3
    assert all(c.profile_id == WHOLE_GPU for c in result.choices)
    engine.commit(result, "p", NEEDS)
    # The other node is untouched, so a second All fits there; a third does not.
    second = placed(place(engine, "q", claim("b", request)))
    assert second.node != result.node
    engine.commit(second, "q", NEEDS)
    assert isinstance(place(engine, "r", claim("c", request)), NoPlacement)
    replay(model)


def test_whole_gpu_and_mig_slices_exclude_each_other() -> None:
    model = build_cluster(1, 1, [A100])
    engine = engine_for(model)
    engine.commit(placed(place(engine, "a", profile_claim("a", "1g.10gb"))), "a", NEEDS)
    whole = place(engine, "b", claim("b", exact("g", cls="gpu.carve.dev")))
    assert isinstance(whole, NoPlacement)


def test_several_gpu_models_and_selector_by_product_name() -> None:
    model = build_cluster(2, 1, [A100, H100])
    engine = engine_for(model)
    selector = 'device.attributes["mig.carve.dev"].productName.startsWith("NVIDIA H100")'
    req = DeviceRequest(
        "r",
        (Alternative("r", ExactRequest("mig.carve.dev", (selector, PROFILE.format("1g.10gb")))),),
    )
    result = placed(place(engine, "p", claim("a", req)))
    assert model.gpus[result.choices[0].gpu_uuid].inventory.model is H100


def test_capacity_request_picks_a_profile_with_enough_memory() -> None:
    model = build_cluster(1, 1, [A100])
    engine = engine_for(model)
    from decimal import Decimal

    req = DeviceRequest(
        "r",
        (
            Alternative(
                "r",
                ExactRequest(
                    "mig.carve.dev", capacity=(("mig.carve.dev/memory", Decimal(30 * 2**30)),)
                ),
            ),
        ),
    )
    result = placed(place(engine, "p", claim("a", req)))
    assert result.choices[0].profile == "3g.40gb"  # the smallest profile with >= 30 GiB


def test_node_fit_is_honoured_and_explained() -> None:
    model = ClusterModel()
    model.set_node(NodeInfo("cordoned", Resources(64000, 2**40, 110), unschedulable=True))
    model.set_node(
        NodeInfo(
            "tainted",
            Resources(64000, 2**40, 110),
            taints=(Taint("gpu", "x", TaintEffect.NO_SCHEDULE),),
        )
    )
    model.set_node(NodeInfo("small", Resources(500, 2**40, 110)))
    for n in ("cordoned", "tainted", "small"):
        model.set_node_gpus(n, [build_gpu(n, 0, A100)])
    engine = engine_for(model)
    result = place(engine, "p", profile_claim("a", "1g.10gb"))
    assert isinstance(result, NoPlacement)
    assert result.reason is NoPlacementReason.NODE_MISFIT
    assert "insufficient cpu" in result.message and "cordoned" in result.message
    tolerant = PodNeeds(
        Resources(1000, 2**30, 1), tolerations=(Toleration("gpu", "Exists", "", ""),)
    )
    ok = placed(engine.place(PlacementRequest("p", tolerant, (profile_claim("a", "1g.10gb"),))))
    assert ok.node == "tainted"
    # The general path (several devices) applies the same filters.
    ok2 = placed(
        engine.place(PlacementRequest("p", tolerant, (profile_claim("a", "1g.10gb", count=2),)))
    )
    assert ok2.node == "tainted"


def test_node_cpu_is_consumed_by_committed_pods() -> None:
    model = ClusterModel()
    model.set_node(node_info("n", cpu=2))
    model.set_node_gpus("n", [build_gpu("n", 0, A100)])
    engine = engine_for(model)
    for i in range(2):
        engine.commit(
            placed(place(engine, f"p{i}", profile_claim(f"c{i}", "1g.10gb"))), f"p{i}", NEEDS
        )
    result = place(engine, "p2", profile_claim("c2", "1g.10gb"))
    assert isinstance(result, NoPlacement)
    assert "insufficient cpu" in result.message


def test_explanation_names_model_profile_and_what_would_free_it() -> None:
    model = build_cluster(1, 2, [H100])
    engine = engine_for(model)
    for i in range(14):
        engine.commit(
            placed(place(engine, f"p{i}", profile_claim(f"c{i}", "1g.10gb"))), f"p{i}", NEEDS
        )
    result = place(engine, "big", profile_claim("big", "3g.40gb"))
    assert isinstance(result, NoPlacement)
    assert "no H100-SXM5-80GB GPU has a free 3g.40gb placement" in result.message
    assert "2 would after 1g.10gb pods finish" in result.message


def test_bad_selector_and_unknown_class_are_permanent() -> None:
    model = build_cluster(1, 1, [A100])
    engine = engine_for(model)
    bad = DeviceRequest(
        "r",
        (
            Alternative(
                "r",
                ExactRequest("mig.carve.dev", ('device.attributes["mig.carve.dev"].nosuch == 1',)),
            ),
        ),
    )
    result = place(engine, "p", claim("a", bad))
    assert isinstance(result, NoPlacement) and result.permanent
    assert result.reason is NoPlacementReason.SELECTOR_ERROR and "nosuch" in result.message
    unknown = place(engine, "p", claim("a", exact("r", cls="nvidia.example.com")))
    assert isinstance(unknown, NoPlacement) and unknown.permanent
    assert "DeviceClass nvidia.example.com does not exist" in unknown.message
    nothing = place(engine, "p", claim("a", exact("r", "9g.999gb")))
    assert (
        isinstance(nothing, NoPlacement) and nothing.reason is NoPlacementReason.NO_MATCHING_DEVICE
    )


def test_selector_reading_uuid_is_evaluated_per_gpu() -> None:
    model = build_cluster(2, 2, [A100])
    engine = engine_for(model)
    selector = 'device.attributes["mig.carve.dev"].parentUUID == "GPU-node-0001-1"'
    req = DeviceRequest("r", (Alternative("r", ExactRequest("mig.carve.dev", (selector,))),))
    result = placed(place(engine, "p", claim("a", req)))
    assert result.choices[0].gpu_uuid == "GPU-node-0001-1"


def test_pinned_node_is_respected() -> None:
    model = build_cluster(3, 1, [A100])
    engine = engine_for(model)
    result = placed(
        engine.place(
            PlacementRequest("p", NEEDS, (profile_claim("a", "1g.10gb"),), node="node-0002")
        )
    )
    assert result.node == "node-0002"


PROFILES = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.5gb", "3g.20gb"]

pod_strategy = st.tuples(
    st.sampled_from(PROFILES),
    st.integers(min_value=1, max_value=3),
    st.sampled_from(["none", "same", "distinct"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(pod_strategy, st.integers(min_value=0, max_value=50)), min_size=1, max_size=30
    ),
    st.sampled_from(list(Policy)),
)
def test_random_pods_never_overlap_and_rebuild_gives_the_same_answers(
    steps: list[tuple[str, int, str] | int], policy: Policy
) -> None:
    model = build_cluster(3, 2, [A100, H100, A100_40])
    engine = engine_for(model, policy)
    live: list[tuple[str, Placement]] = []
    for i, step in enumerate(steps):
        if isinstance(step, int):
            if live:
                pod, placement = live.pop(step % len(live))
                for hold in placement.holds():
                    model.release(hold.claim)
                model.remove_pod(pod)
            continue
        profile, count, constraint = step
        constraints = []
        if constraint != "none":
            kind = ConstraintKind.MATCH if constraint == "same" else ConstraintKind.DISTINCT
            constraints = [DeviceConstraint((), kind, "mig.carve.dev/parentUUID")]
        before = model.snapshot()
        result = place(
            engine,
            f"p{i}",
            claim(f"c{i}", exact("r", profile, count=count), constraints=constraints),
        )
        assert model.snapshot() == before
        if isinstance(result, Placement):
            assert len(result.choices) == count
            assert len({c.node for c in result.choices}) == 1
            uuids = [c.gpu_uuid for c in result.choices]
            if constraint == "same":
                assert len(set(uuids)) == 1
            if constraint == "distinct":
                assert len(set(uuids)) == count
            assert all(c.profile == profile for c in result.choices)
            engine.commit(result, f"p{i}", NEEDS)
            live.append((f"p{i}", result))
        replay(model)

    # Rebuild from scratch (holds in reverse order) and ask the same questions.
    rebuilt = build_cluster(3, 2, [A100, H100, A100_40])
    for hold in reversed(list(model.holds())):
        rebuilt.hold(hold)
    for pod, placement in live:
        rebuilt.set_pod(pod, placement.node, NEEDS.requests)
    assert rebuilt.snapshot() == model.snapshot()
    other = engine_for(rebuilt, policy)
    for profile in PROFILES:
        for count in (1, 2):
            req = (claim("probe", exact("r", profile, count=count)),)
            assert engine.place(PlacementRequest("x", NEEDS, req)) == other.place(
                PlacementRequest("x", NEEDS, req)
            )


def test_general_path_agrees_with_single_device_fast_path() -> None:
    # A trivially true constraint forces the general path for one device.
    model = build_cluster(4, 2, [A100, H100])
    engine = engine_for(model)
    for i, profile in enumerate(["1g.10gb", "3g.40gb", "2g.20gb", "1g.10gb", "4g.40gb"]):
        engine.commit(
            placed(place(engine, f"p{i}", profile_claim(f"c{i}", profile))), f"p{i}", NEEDS
        )
    same = DeviceConstraint((), ConstraintKind.MATCH, "mig.carve.dev/type")
    for profile in ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]:
        fast = placed(place(engine, "x", claim("x", exact("r", profile))))
        slow = placed(place(engine, "x", claim("x", exact("r", profile), constraints=[same])))
        assert fast.loss == slow.loss
        fast_gpu, slow_gpu = (
            model.gpus[fast.choices[0].gpu_uuid],
            model.gpus[slow.choices[0].gpu_uuid],
        )
        assert fast_gpu.occupancy == slow_gpu.occupancy


@pytest.mark.parametrize("policy", list(Policy))
def test_first_fit_takes_first_gpu_and_first_nvml_placement(policy: Policy) -> None:
    model = build_cluster(2, 2, [A100])
    engine = engine_for(model, policy)
    result = placed(place(engine, "p", profile_claim("a", "1g.10gb")))
    if policy is Policy.FIRST_FIT:
        assert result.choices[0].gpu_uuid == "GPU-node-0000-0"
        assert result.choices[0].start == A100.profile_by_id(19).placements[0].start


def test_custom_class_selectors_apply() -> None:
    model = build_cluster(1, 1, [A100])
    size = 'device.attributes["mig.carve.dev"].placementSize <= 2'
    classes = {
        **CLASSES,
        "small.mig.carve.dev": DeviceClass(
            "small.mig.carve.dev", ('device.attributes["mig.carve.dev"].type == "mig"', size)
        ),
        "careless.mig.carve.dev": DeviceClass("careless.mig.carve.dev", (size,)),
    }
    engine = PlacementEngine(model, classes)
    result = placed(place(engine, "p", claim("a", exact("r", cls="small.mig.carve.dev"))))
    choice = result.choices[0]
    assert A100.profile_by_id(choice.profile_id).size <= 2
    # As in Kubernetes, a selector that reads an attribute some class devices lack is an error
    # (the whole-GPU device has no placementSize), not a silent non-match.
    careless = place(engine, "p", claim("a", exact("r", cls="careless.mig.carve.dev")))
    assert isinstance(careless, NoPlacement) and careless.permanent
    assert "placementSize" in careless.message


def test_request_several_models_serve_goes_to_the_model_with_more_room() -> None:
    # 1g.10gb exists on A100-80GB (1 unit) and A100-40GB (2 units). The 80GB GPU is half used,
    # so its room is kept for requests only it can serve (4g.40gb, 7g.80gb...).
    model = build_cluster(2, 1, [A100, A100_40])
    engine = engine_for(model)
    big = placed(place(engine, "a", profile_claim("a", "4g.40gb")))
    engine.commit(big, "a", NEEDS)
    assert model.utilization(A100.key) == 0.5 and model.utilization(A100_40.key) == 0.0
    small = placed(place(engine, "b", profile_claim("b", "1g.10gb")))
    assert model.gpus[small.choices[0].gpu_uuid].inventory.model is A100_40
    # Within one model, packing still wins: the next 1g.10gb shares the 40GB GPU.
    engine.commit(small, "b", NEEDS)
    again = placed(place(engine, "c", profile_claim("c", "1g.10gb")))
    assert again.choices[0].gpu_uuid == small.choices[0].gpu_uuid


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=4000),  # cpu millicores allocatable
            st.booleans(),  # cordoned
            st.booleans(),  # tainted
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.tuples(st.sampled_from(PROFILES), st.integers(1, 2)), min_size=1, max_size=12),
)
def test_every_placement_passes_node_fit(
    nodes: list[tuple[int, bool, bool]], pods: list[tuple[str, int]]
) -> None:
    model = ClusterModel()
    for i, (cpu, cordoned, tainted) in enumerate(nodes):
        name = f"n{i}"
        taints = (Taint("dedicated", "x", TaintEffect.NO_EXECUTE),) if tainted else ()
        model.set_node(NodeInfo(name, Resources(cpu, 2**40, 110), (), taints, cordoned))
        model.set_node_gpus(name, [build_gpu(name, 0, A100), build_gpu(name, 1, H100)])
    engine = engine_for(model)
    needs = PodNeeds(Resources(700, 2**30, 1))
    for j, (profile, count) in enumerate(pods):
        result = engine.place(
            PlacementRequest(f"p{j}", needs, (profile_claim(f"c{j}", profile, count),))
        )
        if isinstance(result, Placement):
            node = model.nodes[result.node]
            assert check_node(needs, node, model.node_usage(node.name)) is None
            engine.commit(result, f"p{j}", needs)
        else:
            fitting = [
                n
                for n in model.nodes.values()
                if check_node(needs, n, model.node_usage(n.name)) is None
            ]
            if result.reason is NoPlacementReason.NODE_MISFIT:
                assert not fitting  # blamed on nodes only when no node would take the pod
            elif fitting:
                assert result.reason in (
                    NoPlacementReason.INSUFFICIENT_DEVICES,
                    NoPlacementReason.NO_MATCHING_DEVICE,
                )
            if result.reason is NoPlacementReason.NO_MATCHING_DEVICE:
                # Only A100-40GB has these; this cluster has none.
                assert profile in ("1g.5gb", "3g.20gb")
    replay(model)


def test_search_budget_bounds_hopeless_multi_device_requests() -> None:
    model = build_cluster(1, 8, [A100])
    engine = PlacementEngine(model, CLASSES, search_budget=50)
    # 8 GPUs x 2 placements = 16 3g.40gb at most; ask for 17 through a constraint that forces
    # the search (distinct placementStart is impossible beyond 2, so it must give up).
    apart = DeviceConstraint((), ConstraintKind.DISTINCT, "mig.carve.dev/placementStart")
    result = place(engine, "p", claim("a", exact("r", "1g.10gb", count=9), constraints=[apart]))
    assert isinstance(result, NoPlacement)
    assert "search limit" in result.message


def test_limits_give_answers_not_crashes() -> None:
    model = build_cluster(1, 8, [A100])
    engine = engine_for(model)
    # All on a node with 8 GPUs x 25 MIG devices: more than a claim's 32 results, and the
    # devices overlap anyway; either way a clear refusal.
    every_mig = DeviceRequest(
        "all",
        (Alternative("all", ExactRequest("mig.carve.dev", mode=AllocationMode.ALL, count=0)),),
    )
    assert isinstance(place(engine, "p", claim("a", every_mig)), NoPlacement)
    # 8 whole GPUs through All fit in one claim (8 <= 32 results).
    whole = DeviceRequest(
        "all",
        (Alternative("all", ExactRequest("gpu.carve.dev", mode=AllocationMode.ALL, count=0)),),
    )
    assert len(placed(place(engine, "p", claim("b", whole))).choices) == 8
    # 5 claims x 32 devices: beyond the per-pod bound, refused before any search.
    many = tuple(claim(f"c{i}", exact("r", "1g.10gb", count=32)) for i in range(5))
    result = engine.place(PlacementRequest("p", NEEDS, many))
    assert isinstance(result, NoPlacement) and "at most 128 per pod" in result.message
    empty = engine.place(PlacementRequest("p", NEEDS, ()))
    assert isinstance(empty, NoPlacement) and empty.permanent


def test_class_changes_and_republished_gpus_are_seen_by_cached_decisions() -> None:
    model = build_cluster(1, 1, [A100])
    classes = dict(CLASSES)
    engine = PlacementEngine(model, classes)
    assert isinstance(place(engine, "p", claim("a", exact("r", "1g.10gb"))), Placement)
    # The DeviceClass is edited in place (as the reconciler's planner does) to exclude 1g.
    classes["mig.carve.dev"] = DeviceClass(
        "mig.carve.dev",
        (
            'device.attributes["mig.carve.dev"].type == "mig"',
            'device.attributes["mig.carve.dev"].placementSize > 1',
        ),
    )
    refused = place(engine, "p", claim("a", exact("r", "1g.10gb")))
    assert isinstance(refused, NoPlacement)
    assert refused.reason is NoPlacementReason.NO_MATCHING_DEVICE
    # The node republishes its GPU as another model: the next decision uses the new devices.
    model.set_node_gpus("node-0000", [build_gpu("node-0000", 0, H100)])
    classes["mig.carve.dev"] = CLASSES["mig.carve.dev"]
    selector = 'device.attributes["mig.carve.dev"].productName == "NVIDIA H100 80GB HBM3"'
    req = DeviceRequest("r", (Alternative("r", ExactRequest("mig.carve.dev", (selector,))),))
    assert isinstance(place(engine, "p", claim("a", req)), Placement)
