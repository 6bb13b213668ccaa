from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.claims import ClaimHold, ClaimKey
from controller.model import WHOLE_GPU, ClusterModel, GpuInventory, inventories_from_slices
from controller.nodefit import NodeInfo
from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from tests.support.cluster_builders import build_cluster, build_gpu

A100 = gpu_model("A100-SXM4-80GB")
DRIVER = "mig.carve.dev"


def hold(name: str, node: str, *devices: str) -> ClaimHold:
    return ClaimHold(
        ClaimKey("ns", name, f"uid-{name}"),
        node,
        tuple(AllocatedDevice("r", DRIVER, node, d) for d in devices),
    )


def test_hold_and_release_drive_the_gpu_state() -> None:
    model = build_cluster(1, 1, [A100])
    gpu = next(iter(model.gpus.values()))
    model.hold(hold("a", "node-0000", "gpu-0-mig-3g40gb-9-4", "gpu-0-mig-1g10gb-19-0"))
    assert gpu.occupancy.state.instances == ((9, 4), (19, 0))
    assert model.node_busy("node-0000")
    model.release(ClaimKey("ns", "a", "uid-a"))
    assert gpu.occupancy.state.instances == ()
    assert not model.node_busy("node-0000")
    assert not gpu.occupancy.in_use


def test_conflicting_holds_block_the_gpu_and_are_reported() -> None:
    model = build_cluster(1, 1, [A100])
    gpu = next(iter(model.gpus.values()))
    model.hold(hold("a", "node-0000", "gpu-0-mig-4g40gb-5-0"))
    model.hold(hold("b", "node-0000", "gpu-0-mig-3g40gb-9-0"))  # overlaps units 0-3
    assert gpu.occupancy.blocked
    (problem,) = model.problems.values()
    assert "conflict" in problem.message and gpu.uuid in problem.message
    model.hold(hold("c", "node-0000", "gpu-0-mig-4g40gb-5-0"))  # the same device twice
    model.release(ClaimKey("ns", "b", "uid-b"))
    assert gpu.occupancy.blocked
    assert "several claims" in next(iter(model.problems.values())).message
    model.release(ClaimKey("ns", "c", "uid-c"))
    assert not gpu.occupancy.blocked and not model.problems
    assert gpu.occupancy.state.instances == ((5, 0),)


def test_whole_gpu_hold_blocks_every_placement() -> None:
    model = build_cluster(1, 1, [A100])
    gpu = next(iter(model.gpus.values()))
    model.hold(hold("a", "node-0000", "gpu-0"))
    assert gpu.holders == {(WHOLE_GPU, 0): {ClaimKey("ns", "a", "uid-a")}}
    assert gpu.occupancy.blocked and not model.problems


def test_holds_seen_before_their_slices_attach_when_the_slices_arrive() -> None:
    model = ClusterModel()
    early = hold("a", "n1", "gpu-0-mig-1g10gb-19-3")
    model.hold(early)
    assert model.unresolved() == {early.claim: ("n1/gpu-0-mig-1g10gb-19-3",)}
    model.set_node_gpus("n1", [build_gpu("n1", 0, A100)])
    assert not model.unresolved()
    assert model.gpus["GPU-n1-0"].occupancy.state.instances == ((19, 3),)
    # Republishing the node keeps the hold (invariant 4: busy until released).
    model.set_node_gpus("n1", [build_gpu("n1", 0, A100)])
    assert model.gpus["GPU-n1-0"].occupancy.state.instances == ((19, 3),)
    # A node that withdraws its GPUs leaves the hold unresolved, not lost.
    model.set_node_gpus("n1", [])
    assert early.claim in model.unresolved()


DEVICES = [
    "gpu-0-mig-1g10gb-19-0",
    "gpu-0-mig-1g10gb-19-6",
    "gpu-0-mig-3g40gb-9-4",
    "gpu-1-mig-4g40gb-5-0",
    "gpu-1-mig-2g20gb-14-4",
    "gpu-1",
    "gpu-0",
]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.sampled_from(["node-0000", "node-0001"]),
            st.lists(st.sampled_from(DEVICES), max_size=2, unique=True),
            st.booleans(),
        ),
        max_size=25,
    ),
    st.randoms(use_true_random=False),
)
def test_incremental_updates_equal_a_rebuild(steps, rng) -> None:  # type: ignore[no-untyped-def]
    model = build_cluster(2, 2, [A100])
    for name, node, devices, release in steps:
        if release:
            model.release(ClaimKey("ns", name, f"uid-{name}"))
        else:
            model.hold(hold(name, node, *devices))
    final = list(model.holds())
    rng.shuffle(final)
    # Rebuild with the holds first and the slices afterwards: order must not matter.
    rebuilt = ClusterModel()
    for h in final:
        rebuilt.hold(h)
    for n in ("node-0000", "node-0001"):
        rebuilt.set_node(model.nodes[n])
        rebuilt.set_node_gpus(n, [g.inventory for g in model.gpus_on(n)])
    assert rebuilt.snapshot() == model.snapshot()
    assert {k: sorted(v) for k, v in rebuilt.buckets.items()} == {
        k: sorted(v) for k, v in model.buckets.items()
    }


def test_pods_count_against_their_node() -> None:
    from controller.nodefit import Resources

    model = build_cluster(1, 1, [A100])
    model.set_pod("ns/p", "node-0000", Resources(500, 100, 1))
    model.set_pod("ns/q", "node-0000", Resources(250, 100, 1))
    assert model.node_usage("node-0000") == Resources(750, 200, 2)
    model.set_pod("ns/p", "node-0000", Resources(100, 0, 1))  # updated, not added twice
    assert model.node_usage("node-0000") == Resources(350, 100, 2)
    model.remove_pod("ns/p")
    model.remove_pod("ns/q")
    assert model.node_usage("node-0000") == Resources()


def test_inventories_from_real_resource_slices_feed_the_engine() -> None:
    from controller.nodefit import PodNeeds, Resources
    from controller.placement import Placement, PlacementEngine, PlacementRequest
    from driver.resourceslice import PublishedGpu, build_resource_slices
    from tests.support.cluster_builders import CLASSES, profile_claim

    h100 = gpu_model("H100-SXM5-80GB")
    slices = build_resource_slices(
        driver=DRIVER,
        node_name="n1",
        pool_generation=1,
        gpus=[
            PublishedGpu(i, f"GPU-{i}", h100, f"0000:{i + 16:02x}:00.0", "580.105.08")
            for i in range(2)
        ],
    )
    inventories = inventories_from_slices(slices, DRIVER)
    assert [g.uuid for g in inventories] == ["GPU-0", "GPU-1"]
    gpu0 = inventories[0]
    facts = {d.name: d for d in gpu0.devices}
    mig = facts["gpu-0-mig-3g40gb-9-4"]
    assert (mig.profile_id, mig.start) == (9, 4)
    assert mig.facts.attribute("mig.carve.dev/parentUUID") == "GPU-0"
    assert facts["gpu-0"].profile_id == WHOLE_GPU
    model = ClusterModel()
    model.set_node(NodeInfo("n1", Resources(8000, 2**35, 110)))
    model.set_node_gpus("n1", inventories)
    engine = PlacementEngine(model, CLASSES)
    result = engine.place(PlacementRequest("p", PodNeeds(), (profile_claim("c", "3g.40gb"),)))
    assert isinstance(result, Placement)
    assert result.choices[0].device in facts or result.choices[0].device.startswith("gpu-1-")


# --- GPUs that offer only MIG slices or only themselves (issue 11, point 4) --------------------


def _published(
    node: str, *gpus: tuple[str, bool, bool], holder: ClusterModel | None = None
) -> ClusterModel:
    """A model of ``node`` from the slices its plugin builds for (catalog key, offers MIG,
    offers whole) per GPU, through the controller's own slice reader."""
    from driver.resourceslice import PublishedGpu, build_resource_slices
    from tests.support.cluster_builders import node_info

    published = [
        PublishedGpu(i, f"GPU-{node}-{i}", gpu_model(key), f"0000:{i + 16:02x}:00.0",
                     "580.105.08", offers_mig=mig, offers_whole=whole)
        for i, (key, mig, whole) in enumerate(gpus)
    ]  # fmt: skip
    slices = build_resource_slices(driver=DRIVER, node_name=node, pool_generation=1, gpus=published)
    model = holder or ClusterModel()
    model.set_node(node_info(node))
    model.set_node_gpus(node, inventories_from_slices(slices, DRIVER))
    return model


def test_gpus_that_withhold_a_kind_of_device_are_explained() -> None:
    from controller.model import withheld_devices_note

    model = _published(
        "n1",
        ("A100-SXM4-40GB", True, False),  # Ampere in MIG mode
        ("A30-24GB", False, True),  # Ampere out of MIG mode
        ("H100-SXM5-80GB", False, True),  # Hopper held whole
        ("H100-SXM5-80GB", True, True),
    )
    note = withheld_devices_note(model.gpus.values())
    # models are named as NVML names them (the product name in the slices)
    assert "NVIDIA A100-SXM4-40GB GPUs in MIG mode offer no whole GPU" in note
    assert "`nvidia-smi -i <GPU> -mig 0`" in note
    assert "NVIDIA A30 GPUs out of MIG mode offer no MIG slice" in note
    assert "NVIDIA H100 80GB HBM3 GPUs allocated whole offer no MIG slice" in note
    assert withheld_devices_note([model.gpus["GPU-n1-3"]]) == ""
    # Only the kind a request can use: a MIG request hears nothing about whole GPUs.
    mig_only = withheld_devices_note(model.gpus.values(), whole=False)
    assert "offer no whole GPU" not in mig_only and "offer no MIG slice" in mig_only
    whole_only = withheld_devices_note(model.gpus.values(), mig=False)
    assert "offer no MIG slice" not in whole_only and "offer no whole GPU" in whole_only


def test_a_whole_gpu_request_goes_only_where_one_is_offered_and_says_why_not() -> None:
    from controller.placement import NoPlacement
    from tests.support.placement import claim, engine_for, exact, place, placed

    whole = exact("gpu", cls="gpu.carve.dev")
    model = _published("n1", ("A100-SXM4-40GB", True, False), ("A100-SXM4-40GB", True, False))
    refused = place(engine_for(model), "p", claim("w", whole))
    assert isinstance(refused, NoPlacement)
    assert "no device published in the cluster matches DeviceClass gpu.carve.dev" in (
        refused.message
    )
    assert "A100-SXM4-40GB GPUs in MIG mode offer no whole GPU" in refused.message
    # A MIG request that matches nothing is not told about whole GPUs.
    nine = exact("mig", "9g.99gb")
    refused = place(engine_for(model), "p", claim("m", nine))
    assert isinstance(refused, NoPlacement)
    assert "selector #0 matches no device" in refused.message
    assert "whole GPU" not in refused.message
    # A second node with one GPU out of MIG mode: the whole GPU goes there, and only there.
    model = _published("n2", ("A100-SXM4-40GB", True, False), ("A100-SXM4-40GB", False, True),
                       holder=model)  # fmt: skip
    got = placed(place(engine_for(model), "p", claim("w", whole)))
    (choice,) = got.choices
    assert (got.node, choice.device) == ("n2", "gpu-1")


# -- one GPU UUID, one node (issue 41.3) ----------------------------------------------------------


def _stolen(uuid_of: str, minor: int, thief: str) -> GpuInventory:
    """Node `thief` publishing the GPU of node `uuid_of` at `minor` (its UUID, its devices)."""
    return replace(build_gpu(uuid_of, minor, A100), node=thief, pool=thief)


def test_a_node_publishing_another_nodes_gpu_uuid_does_not_remove_that_gpu() -> None:
    """Before, the newer publication won: the victim's GPU left the model."""
    model = ClusterModel()
    victim = build_gpu("victim", 0, A100)
    model.set_node_gpus("victim", [victim])
    model.hold(hold("a", "victim", "gpu-0-mig-3g40gb-9-4"))
    model.set_node_gpus("thief", [_stolen("victim", 0, "thief"), build_gpu("thief", 1, A100)])
    assert model.gpus[victim.uuid].node == "victim"
    assert model.gpus[victim.uuid].occupancy.state.instances == ((9, 4),)
    assert {g.uuid for g in model.gpus_on("thief")} == {"GPU-thief-1"}
    assert model.duplicate_gpus == {(victim.uuid, "thief"): "victim"}

    model.set_node_gpus("victim", [victim])  # republishing keeps it on the victim
    assert model.gpus[victim.uuid].node == "victim"
    model.set_node_gpus("thief", [build_gpu("thief", 1, A100)])
    assert model.duplicate_gpus == {}


def test_a_gpu_given_up_by_its_node_counts_where_it_is_also_published() -> None:
    """A GPU that really moved (its old node's slices go later) is not lost for good."""
    model = ClusterModel()
    model.set_node_gpus("old", [build_gpu("old", 0, A100)])
    model.set_node_gpus("new", [_stolen("old", 0, "new")])
    assert model.duplicate_gpus == {("GPU-old-0", "new"): "old"}
    model.set_node_gpus("old", [])
    assert model.gpus["GPU-old-0"].node == "new" and model.duplicate_gpus == {}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["n0", "n1", "n2"]), st.sets(st.integers(0, 3), max_size=3)),
        max_size=12,
    )
)
def test_every_published_uuid_counts_once_on_a_node_that_publishes_it(
    publications: list[tuple[str, set[int]]],
) -> None:
    """GPU k is `GPU-shared-k` whichever node publishes it: nodes fight over the same UUIDs."""
    model = ClusterModel()
    now: dict[str, set[int]] = {}
    for node, ks in publications:
        model.set_node_gpus(node, [_stolen("shared", k, node) for k in sorted(ks)])
        now[node] = ks
        published = {f"GPU-shared-{k}": {n for n, s in now.items() if k in s} for k in range(4)}
        for uuid, publishers in published.items():
            if not publishers:
                assert uuid not in model.gpus
                continue
            holder = model.gpus[uuid].node
            assert holder in publishers
            ignored = {c for (u, c) in model.duplicate_gpus if u == uuid}
            assert ignored == publishers - {holder}  # every other publisher is told
        for (uuid, claimant), holder in model.duplicate_gpus.items():
            assert model.gpus[uuid].node == holder and holder != claimant
        counted = [u for n in model.gpu_nodes() for u in (g.uuid for g in model.gpus_on(n))]
        assert len(counted) == len(set(counted)) == len(model.gpus)
