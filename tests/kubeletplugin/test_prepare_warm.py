"""Warm slices in the prepare/unprepare state machine (kubeletplugin.warm, docs/kubeletplugin.md).

The real Preparer on the NVML simulator: a released claim's instance is kept only when no
process is left on it and the profile recurs on the GPU; it is reused only by a claim allocated
exactly its profile and placement in its namespace; anything else that needs its space reclaims
it; a restart neither forgets it nor calls it foreign.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from driver.nvml import sim
from kubeletplugin.checkpoint import WarmState
from kubeletplugin.ports import ClaimRef
from kubeletplugin.warm import Demand, WarmSettings
from tests.kubeletplugin.node_harness import Node, mig, open_node, whole

H100 = "H100-SXM5-80GB"
P_1G = 19  # 1g.10gb on an H100
P_2G = 14  # 2g.20gb
ON = WarmSettings(ttl_s=60.0)


def _node(root: Path, warm: WarmSettings = ON) -> Node:
    n = open_node(root, [H100, H100])
    n.warm = warm
    n.start()
    return n


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = _node(tmp_path)
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _prepared(n: Node, name: str, device: str, namespace: str = "default") -> ClaimRef:
    ref = n.claims.add(name, [device], namespace=namespace)
    result = n.p.prepare([ref])[ref.uid]
    assert result.error == "", result.error
    return ref


def _mig_uuid(n: Node, ref: ClaimRef) -> str:
    (d,) = n.p.checkpoint().claims[ref.uid].devices
    assert d.mig_uuid is not None
    return d.mig_uuid


def _warm_one(n: Node, start: int = 3, namespace: str = "default") -> str:
    """Leave a warm 1g instance at `start` on GPU 0; returns its MIG UUID."""
    a = _prepared(n, f"a{start}", mig(n.backend, 0, P_1G, start), namespace)
    _prepared(n, f"b{start}", mig(n.backend, 0, P_1G, (start + 1) % 7), namespace)
    uuid = _mig_uuid(n, a)
    assert n.p.unprepare([a]) == {a.uid: ""}
    return uuid


def test_a_released_slice_is_kept_warm_and_then_reused_without_carving(node: Node) -> None:
    a = _prepared(node, "a", mig(node.backend, 0, P_1G, 3))
    _prepared(node, "b", mig(node.backend, 0, P_1G, 4))  # the profile recurs on GPU 0
    kept = _mig_uuid(node, a)
    assert node.p.unprepare([a]) == {a.uid: ""}

    (warm,) = node.p.warm_instances()
    assert (warm.mig_uuid, warm.placement_start, warm.state) == (kept, 3, WarmState.IDLE)
    assert (0, P_1G, 3, 1) in node.instances()  # still carved
    assert a.uid not in node.p.checkpoint().claims
    assert node.claims.finalizers(a) == []  # released: the controller may allocate it again
    assert not (node.cdi_root / f"mig.carve.dev-claim_{a.uid}.json").exists()

    # Carving would fail now: the next claim there must get the kept instance instead.
    sim.sim_inject_fault("DeviceCreateGpuInstanceWithPlacement", error="UNKNOWN", times=5)
    c = _prepared(node, "c", mig(node.backend, 0, P_1G, 3))
    assert _mig_uuid(node, c) == kept
    assert node.p.warm_instances() == ()
    assert node.p.metrics.warm_outcomes.labels(outcome="reused")._value.get() == 1


def test_without_a_recurring_profile_the_instance_is_destroyed(node: Node) -> None:
    a = _prepared(node, "a", mig(node.backend, 0, P_1G, 3))
    assert node.p.unprepare([a]) == {a.uid: ""}
    assert node.p.warm_instances() == ()
    assert node.instances() == []


def test_warm_slices_off_destroys_as_before(tmp_path: Path) -> None:
    n = _node(tmp_path, WarmSettings())
    try:
        a = _prepared(n, "a", mig(n.backend, 0, P_1G, 3))
        b = _prepared(n, "b", mig(n.backend, 0, P_1G, 4))
        assert n.p.unprepare([a, b]) == {a.uid: "", b.uid: ""}
        assert n.p.warm_instances() == () and n.instances() == []
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_slice_with_a_process_left_is_never_kept(node: Node) -> None:
    a = _prepared(node, "a", mig(node.backend, 0, P_1G, 3))
    _prepared(node, "b", mig(node.backend, 0, P_1G, 4))
    (d,) = node.p.checkpoint().claims[a.uid].devices
    assert d.gi_id is not None and d.ci_id is not None
    sim.sim_set_processes(0, d.gi_id, d.ci_id, [4242])
    # Not kept; and, as without warm slices, NVML refuses to destroy it while the process runs.
    error = node.p.unprepare([a])[a.uid]
    assert "still has processes" in error
    assert node.p.warm_instances() == ()
    sim.sim_set_processes(0, d.gi_id, d.ci_id, [])
    assert node.p.unprepare([a]) == {a.uid: ""}  # the kubelet's retry


def test_a_process_on_a_warm_slice_blocks_its_reuse_with_a_message(node: Node) -> None:
    _warm_one(node)
    (warm,) = node.p.warm_instances()
    sim.sim_set_processes(0, warm.gi_id, warm.ci_id, [777])
    c = node.claims.add("c", [mig(node.backend, 0, P_1G, 3)])
    error = node.p.prepare([c])[c.uid].error
    assert "has processes running although no claim owns it (pids 777)" in error
    assert node.p.warm_instances() == (warm,)  # neither handed out nor destroyed


def test_another_namespace_does_not_reuse_it_by_default_and_reclaims_it(node: Node) -> None:
    kept = _warm_one(node, namespace="team-a")
    c = _prepared(node, "c", mig(node.backend, 0, P_1G, 3), namespace="team-b")
    assert _mig_uuid(node, c) != kept  # a fresh instance: the old one was destroyed first
    assert node.p.warm_instances() == ()
    assert node.p.metrics.warm_outcomes.labels(outcome="reclaimed")._value.get() == 1


def test_reuse_across_namespaces_is_an_opt_in(tmp_path: Path) -> None:
    n = _node(tmp_path, WarmSettings(ttl_s=60.0, across_namespaces=True))
    try:
        kept = _warm_one(n, namespace="team-a")
        c = _prepared(n, "c", mig(n.backend, 0, P_1G, 3), namespace="team-b")
        assert _mig_uuid(n, c) == kept
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_an_overlapping_placement_reclaims_the_warm_instance(node: Node) -> None:
    _warm_one(node, start=2)  # 1g at slice 2 warm, a 1g at slice 3 still prepared
    c = _prepared(node, "c", mig(node.backend, 0, P_2G, 0))  # 2g.20gb on slices 0-1: free
    assert node.p.warm_instances() != ()  # not in the way: kept
    d = _prepared(node, "d", mig(node.backend, 1, P_1G, 0))
    assert c and d
    e = node.claims.add("e", [mig(node.backend, 0, P_2G, 2)])  # slices 2-3: over the warm one
    # Slice 3 is still held by a prepared claim, so NVML refuses; the warm one was reclaimed.
    assert "placement" in node.p.prepare([e])[e.uid].error
    assert node.p.warm_instances() == ()
    assert (0, P_1G, 2, 1) not in node.instances()


def test_a_whole_gpu_claim_reclaims_the_gpus_warm_instances(tmp_path: Path) -> None:
    n = _node(tmp_path)
    try:
        a = _prepared(n, "a", mig(n.backend, 0, P_1G, 3))
        b = _prepared(n, "b", mig(n.backend, 0, P_1G, 4))
        assert n.p.unprepare([a]) == {a.uid: ""}
        assert n.p.unprepare([b]) == {b.uid: ""}
        assert len(n.p.warm_instances()) == 2
        w = _prepared(n, "w", whole(0))
        assert w and n.p.warm_instances() == ()
        assert not n.backend.mig_enabled(n.gpu_uuid(0))
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_restart_keeps_warm_instances_and_does_not_call_them_foreign(node: Node) -> None:
    kept = _warm_one(node)
    node.start()
    (warm,) = node.p.warm_instances()
    assert warm.mig_uuid == kept
    assert node.p.checkpoint().foreign == ()
    c = _prepared(node, "c", mig(node.backend, 0, P_1G, 3))
    assert _mig_uuid(node, c) == kept


def test_turning_warm_slices_off_reclaims_them_at_start(node: Node) -> None:
    _warm_one(node)
    node.warm = WarmSettings()
    node.start()
    assert node.p.warm_instances() == ()
    assert (0, P_1G, 3, 1) not in node.instances()
    assert node.p.checkpoint().foreign == ()


def test_expired_instances_are_reclaimed_once_their_profile_stops_coming(node: Node) -> None:
    _warm_one(node)
    (warm,) = node.p.warm_instances()
    node.p.ledger.save(lambda cp: cp.with_warm((replace(warm, since=warm.since - 61.0),)))
    node.p.reclaim_expired()
    # Past the TTL, but claims of its profile still come to the GPU: destroying it now would
    # hold the GPU for a second in their way, and it blocks no placement.
    assert node.p.warm_instances() != ()
    node.p.warm.demand = Demand(ON.ttl_s)  # what the window looks like once they stopped coming
    node.p.reclaim_expired()
    assert node.p.warm_instances() == ()
    assert node.p.metrics.warm_outcomes.labels(outcome="expired")._value.get() == 1


def test_a_gpu_keeps_at_most_max_per_gpu_warm_instances(tmp_path: Path) -> None:
    n = _node(tmp_path, WarmSettings(ttl_s=60.0, max_per_gpu=2))
    try:
        refs = [_prepared(n, f"c{i}", mig(n.backend, 0, P_1G, i)) for i in range(4)]
        assert n.p.unprepare(refs) == {r.uid: "" for r in refs}
        assert len(n.p.warm_instances()) == 2
        assert len(n.instances()) == 2  # the others were destroyed at unprepare
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_reclaim_interrupted_by_a_crash_is_finished_at_start(node: Node) -> None:
    _warm_one(node)
    (warm,) = node.p.warm_instances()
    # What a crash between the RECLAIMING save and the destroy leaves behind.
    node.p.ledger.save(lambda cp: cp.with_warm((replace(warm, state=WarmState.RECLAIMING),)))
    sim.sim_inject_fault("DeviceCreateGpuInstanceWithPlacement", error="UNKNOWN", times=5)
    node.start()
    assert node.p.warm_instances() == ()
    assert (0, P_1G, 3, 1) not in node.instances()
    c = node.claims.add("c", [mig(node.backend, 0, P_1G, 3)])
    assert "failed" in node.p.prepare([c])[c.uid].error  # never handed out: it had to carve


def test_a_warm_instance_that_vanished_is_forgotten_at_start(node: Node) -> None:
    _warm_one(node)
    (warm,) = node.p.warm_instances()
    node.backend.destroy(warm.gpu_uuid, warm.gi_id)  # e.g. a GPU reset while the plugin was down
    node.start()
    assert node.p.warm_instances() == ()
    assert node.p.metrics.warm_outcomes.labels(outcome="vanished")._value.get() == 1


# --- the invariants, on random sequences ----------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["prepare", "prepare", "unprepare", "unprepare", "expire", "restart"]),
        st.integers(0, 2),  # 1g placement start on GPU 0 (few: so that they recur)
        st.sampled_from(["team-a", "team-b"]),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
@example(
    ops=[
        ("prepare", 0, "team-a"),
        ("prepare", 1, "team-a"),
        ("unprepare", 0, "team-a"),
        ("prepare", 0, "team-b"),
    ]
)
def test_every_instance_has_exactly_one_owner_and_reuse_stays_in_its_namespace(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, int, str]]
) -> None:
    n = _node(tmp_path_factory.mktemp("warm"))
    released_by: dict[str, str] = {}  # MIG UUID -> namespace of the claim that released it
    live: dict[str, ClaimRef] = {}  # placement start -> prepared claim
    try:
        for i, (op, start, ns) in enumerate(ops):
            key = str(start)
            if op == "prepare" and key not in live:
                ref = n.claims.add(f"c{i}", [mig(n.backend, 0, P_1G, start)], namespace=ns)
                assert n.p.prepare([ref])[ref.uid].error == ""
                got = _mig_uuid(n, ref)
                if got in released_by:
                    assert released_by.pop(got) == ns  # reuse never crosses namespaces
                live[key] = ref
            elif op == "unprepare" and live:
                ref = live.pop(next(iter(live)))  # the oldest claim, wherever it is
                uuid = _mig_uuid(n, ref)
                assert n.p.unprepare([ref]) == {ref.uid: ""}
                released_by[uuid] = ref.namespace
            elif op == "expire":
                n.p.ledger.save(
                    lambda cp: cp.with_warm(tuple(replace(w, since=0.0) for w in cp.warm))
                )
                n.p.reclaim_expired()
            elif op == "restart":
                n.start()
            cp = n.p.checkpoint()
            owned = [
                (d.gpu_uuid, d.gi_id)
                for r in cp.claims.values()
                for d in r.devices
                if d.gi_id is not None
            ]
            warm = [(w.gpu_uuid, w.gi_id) for w in cp.warm]
            on_gpu = [
                (g.uuid, inst.gi_id)
                for g in n.backend.gpus()
                if n.backend.mig_enabled(g.uuid)
                for inst in n.backend.instances(g.uuid)
            ]
            assert sorted(owned + warm) == sorted(on_gpu)  # one owner each, none unowned
            assert cp.foreign == ()
            assert len(cp.claims) == len(live)
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)
