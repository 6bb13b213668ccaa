from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.packing import build_cluster, build_gpu
from controller.claims import AllocatedDevice, ClaimHold, ClaimKey
from controller.model import WHOLE_GPU, ClusterModel
from driver.catalog import gpu_model

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
