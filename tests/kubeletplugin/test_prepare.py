from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver import cdi
from driver.config import API_VERSION
from driver.nvml import sim
from kubeletplugin.checkpoint import CheckpointStore, ClaimState
from kubeletplugin.foreign import ForeignPolicy
from kubeletplugin.ports import ClaimRef
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, open_node, whole

H100 = "H100-SXM5-80GB"
A100 = "A100-SXM4-40GB"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [H100, H100])
    n.start()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _spec(n: Node, uid: str) -> dict[str, Any]:
    return cdi.load_spec(CdiWriterPath(n, uid))


def CdiWriterPath(n: Node, uid: str) -> Path:  # noqa: N802 - reads like a constructor
    return n.cdi_root / f"{DRIVER}-claim_{uid}.json"


def test_prepare_carves_exact_placement_and_writes_cdi(node: Node) -> None:
    dev = mig(node.backend, 0, 19, 3)  # 1g.10gb at memory slice 3
    ref = node.claims.add("c1", [dev])
    result = node.p.prepare([ref])[ref.uid]
    assert result.error == ""
    (prepared,) = result.devices
    assert prepared.device_name == dev and prepared.pool_name == NODE
    assert prepared.request_names == ("req0",)
    assert prepared.cdi_device_ids == (f"{DRIVER}/claim={ref.uid}-{dev}",)
    assert node.instances() == [(0, 19, 3, 1)]

    rec = node.p.checkpoint().claims[ref.uid]
    assert rec.state is ClaimState.PREPARE_COMPLETED
    (d,) = rec.devices
    assert d.gi_id is not None and d.ci_id is not None and d.mig_uuid
    live = node.backend.instances(node.gpu_uuid(0))
    assert [(i.gi_id, i.mig_uuid) for i in live] == [(d.gi_id, d.mig_uuid)]
    assert node.claims.finalizers(ref) == [f"{DRIVER}/node-{NODE}"]

    edits = cdi.resolve([node.cdi_root], prepared.cdi_device_ids)
    assert f"NVIDIA_VISIBLE_DEVICES={d.mig_uuid}" in edits.env
    paths = {n["path"]: n for n in edits.device_nodes}
    gi_minor, ci_minor = node.backend.cap_minors(0, d.gi_id, d.ci_id)
    assert set(paths) == {
        "/dev/nvidia0",
        "/dev/nvidiactl",
        f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
        f"/dev/nvidia-caps/nvidia-cap{ci_minor}",
    }
    assert paths[f"/dev/nvidia-caps/nvidia-cap{gi_minor}"]["major"] == node.backend.caps_major()


def test_prepare_is_idempotent(node: Node) -> None:
    ref = node.claims.add("c1", [mig(node.backend, 1, 9, 4)])
    first = node.p.prepare([ref])[ref.uid]
    reads = node.claims.reads
    second = node.p.prepare([ref])[ref.uid]
    assert first == second and first.error == ""
    assert node.instances() == [(1, 9, 4, 1)]
    assert node.claims.reads == reads  # answered from the checkpoint


def test_unprepare_destroys_and_is_idempotent(node: Node) -> None:
    ref = node.claims.add("c1", [mig(node.backend, 0, 14, 2)])
    assert node.p.prepare([ref])[ref.uid].error == ""
    assert node.p.unprepare([ref]) == {ref.uid: ""}
    assert node.instances() == []
    assert not CdiWriterPath(node, ref.uid).exists()
    assert node.claims.finalizers(ref) == []
    assert ref.uid not in node.p.checkpoint().claims
    assert node.p.unprepare([ref]) == {ref.uid: ""}
    # the placement is free again for the next claim
    ref2 = node.claims.add("c2", [mig(node.backend, 0, 14, 2)])
    assert node.p.prepare([ref2])[ref2.uid].error == ""


def test_bad_claims_fail_individually_with_specific_messages(node: Node) -> None:
    good = node.claims.add("good", [mig(node.backend, 0, 19, 0)])
    taken_owner = node.claims.add("owner", [mig(node.backend, 1, 15, 2)])
    assert node.p.prepare([taken_owner])[taken_owner.uid].error == ""

    unknown = node.claims.add("unknown", ["gpu-7-mig-1g10gb-19-0"])
    bad_profile = node.claims.add("badprofile", ["gpu-0-mig-1g10gb-99-0"])
    other_driver = node.claims.add("otherdrv", [("gpu.nvidia.com", NODE, "gpu-0")])
    other_node = node.claims.add("othernode", [(DRIVER, "node-b", mig(node.backend, 0, 19, 1))])
    wrong_uid = node.claims.add("wronguid", [mig(node.backend, 0, 19, 2)])
    wrong_uid = type(wrong_uid)(wrong_uid.namespace, wrong_uid.name, "not-the-uid")
    deleted = node.claims.add("deleted", [mig(node.backend, 0, 19, 4)])
    node.claims.delete(deleted)
    deleting = node.claims.add("deleting", [mig(node.backend, 0, 19, 4)])
    node.claims.objects[("default", "deleting")]["metadata"]["finalizers"] = ["other.io/x"]
    node.claims.delete(deleting)
    taken = node.claims.add("taken", [mig(node.backend, 1, 19, 3)])  # overlaps owner's 2-3
    bad_config = node.claims.add(
        "badconfig",
        [mig(node.backend, 0, 19, 5)],
        config=[
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {
                        "apiVersion": API_VERSION,
                        "kind": "MigDeviceConfig",
                        "sharing": {"strategy": "MPS", "mpsConfig": {"threads": 3}},
                    },
                },
            }
        ],
    )
    unallocated = node.claims.add("unalloc", [], allocated=False)
    refs = [
        good, unknown, bad_profile, other_driver, other_node, wrong_uid, deleted, taken,
        bad_config, unallocated, deleting,
    ]  # fmt: skip
    results = node.p.prepare(refs)
    assert set(results) == {r.uid for r in refs}
    assert results[good.uid].error == "" and len(results[good.uid].devices) == 1
    expect = {
        unknown.uid: "not a device of this node",
        bad_profile.uid: "has no MIG profile id 99",
        other_driver.uid: f"no device is allocated by driver {DRIVER}",
        other_node.uid: "allocated from pool 'node-b'",
        wrong_uid.uid: "now has UID",
        deleted.uid: "not found (was it deleted?)",
        taken.uid: "already taken by claim default/owner",
        bad_config.uid: "unknown field(s) 'threads'",
        unallocated.uid: "not allocated",
        deleting.uid: "being deleted",
    }
    for uid, fragment in expect.items():
        assert fragment in results[uid].error, (fragment, results[uid].error)
        assert results[uid].devices == ()
    # nothing leaked from the failures: the good claim and the owner hold one instance each
    assert node.instances() == [(0, 19, 0, 1), (1, 15, 2, 1)]
    assert set(node.p.checkpoint().claims) == {good.uid, taken_owner.uid}
    assert node.claims.finalizers(taken) == []
    assert sorted(p.name for p in node.cdi_root.iterdir()) == sorted(
        f"{DRIVER}-claim_{u}.json" for u in (good.uid, taken_owner.uid)
    )


def test_opaque_config_lands_in_cdi_env(node: Node) -> None:
    # (MPS config needs the MPS control daemon; its env is in test_prepare_mps.py.)
    params = {
        "apiVersion": API_VERSION,
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    }
    ref = node.claims.add(
        "cfg",
        [mig(node.backend, 0, 19, 0)],
        config=[
            {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {
                **params, "sharing": {"strategy": "None"}}}},
            {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}},
        ],
    )  # fmt: skip
    res = node.p.prepare([ref])[ref.uid]
    env = cdi.resolve([node.cdi_root], res.devices[0].cdi_device_ids).env
    assert "CARVE_SHARING_STRATEGY=TimeSlicing" in env
    assert "CARVE_TIME_SLICE_INTERVAL=Long" in env


def test_a_request_with_a_count_sees_all_its_slices(node: Node) -> None:
    devices = [mig(node.backend, 0, 19, 0), mig(node.backend, 0, 19, 1)]
    ref = node.claims.add("two", devices, requests=("gpus", "gpus"))
    res = node.p.prepare([ref])[ref.uid]
    assert res.error == "" and len(res.devices) == 2
    uuids = [d.mig_uuid for d in node.p.checkpoint().claims[ref.uid].devices]
    for device in res.devices:
        env = cdi.resolve([node.cdi_root], device.cdi_device_ids).env
        assert f"NVIDIA_VISIBLE_DEVICES={','.join(u or '' for u in uuids)}" in env


def test_each_request_names_only_its_own_slices(node: Node) -> None:
    """The kubelet gives a container that names one request only that request's CDI devices;
    their environment must not name the other request's slice."""
    ref = node.claims.add("two", [mig(node.backend, 0, 19, 0), mig(node.backend, 0, 19, 1)])
    res = node.p.prepare([ref])[ref.uid]
    records = node.p.checkpoint().claims[ref.uid].devices
    for device, record in zip(res.devices, records, strict=True):
        env = cdi.resolve([node.cdi_root], device.cdi_device_ids).env
        assert f"NVIDIA_VISIBLE_DEVICES={record.mig_uuid}" in env


def test_overlapping_devices_in_one_claim_rejected(node: Node) -> None:
    ref = node.claims.add("overlap", [mig(node.backend, 0, 14, 0), mig(node.backend, 0, 19, 1)])
    assert "overlaps another device" in node.p.prepare([ref])[ref.uid].error
    assert node.instances() == []


def test_many_claims_in_parallel_on_two_gpus(node: Node) -> None:
    refs = [node.claims.add(f"c{g}{s}", [mig(node.backend, g, 19, s)]) for g in (0, 1)
            for s in range(7)]  # fmt: skip
    results = node.p.prepare(refs)
    assert all(r.error == "" for r in results.values()), results
    assert len(node.instances()) == 14
    assert set(node.p.unprepare(refs).values()) == {""}
    assert node.instances() == []


def test_whole_gpu_device(node: Node) -> None:
    ref = node.claims.add("whole", [whole(1)])
    res = node.p.prepare([ref])[ref.uid]
    assert res.error == ""
    edits = cdi.resolve([node.cdi_root], res.devices[0].cdi_device_ids)
    assert f"NVIDIA_VISIBLE_DEVICES={node.gpu_uuid(1)}" in edits.env
    busy = node.claims.add("slice", [mig(node.backend, 0, 19, 0)])
    node.p.prepare([busy])
    ref2 = node.claims.add("whole0", [whole(0)])
    assert "is in use by claim default/slice" in node.p.prepare([ref2])[ref2.uid].error
    assert node.p.unprepare([busy]) == {busy.uid: ""}
    node.backend.carve(node.gpu_uuid(0), 19, 6)  # an instance carve did not create
    assert "has 1 MIG instance(s)" in node.p.prepare([ref2])[ref2.uid].error


def test_nvml_failure_mid_prepare_rolls_back(node: Node) -> None:
    ref = node.claims.add("c1", [mig(node.backend, 0, 19, 0), mig(node.backend, 1, 19, 0)])
    sim.sim_inject_fault("CreateComputeInstance", error="INSUFFICIENT_RESOURCES", gpu=1)
    res = node.p.prepare([ref])[ref.uid]
    assert "creating 1g.10gb" in res.error
    assert node.instances() == []  # gpu-0's slice was torn down too
    assert node.p.checkpoint().claims == {}
    assert node.claims.finalizers(ref) == []
    assert node.p.prepare([ref])[ref.uid].error == ""  # the kubelet's retry works
    assert len(node.instances()) == 2


def test_destroy_in_use_keeps_record_until_retry(node: Node) -> None:
    ref = node.claims.add("busy", [mig(node.backend, 0, 19, 6)])
    node.p.prepare([ref])
    d = node.p.checkpoint().claims[ref.uid].devices[0]
    assert d.gi_id is not None and d.ci_id is not None
    sim.sim_set_busy(0, d.gi_id, d.ci_id)
    err = node.p.unprepare([ref])[ref.uid]
    assert "still has processes" in err
    assert node.p.checkpoint().claims[ref.uid].state is ClaimState.UNPREPARE_STARTED
    assert node.claims.finalizers(ref)  # the placement stays busy for the controller
    sim.sim_set_busy(0, d.gi_id, d.ci_id, busy=False)
    assert node.p.unprepare([ref])[ref.uid] == ""
    assert node.instances() == [] and node.claims.finalizers(ref) == []


def test_finalizer_removal_failure_is_retried(node: Node) -> None:
    ref = node.claims.add("fin", [mig(node.backend, 0, 19, 6)])
    node.p.prepare([ref])
    node.claims.fail_finalizer_removal = True
    assert "removing finalizer" in node.p.unprepare([ref])[ref.uid]
    assert node.instances() == []
    node.claims.fail_finalizer_removal = False
    node.p.retry_pending()
    assert node.claims.finalizers(ref) == [] and node.p.checkpoint().claims == {}


def test_ampere_with_mig_off_gives_actionable_error(tmp_path: Path) -> None:
    n = open_node(tmp_path, [{"model": A100, "mig": False}, {"model": H100, "mig": False}])
    try:
        n.start()
        a = n.claims.add("a", [mig(n.backend, 0, 19, 0)])
        h = n.claims.add("h", [mig(n.backend, 1, 19, 0)])
        res = n.p.prepare([a, h])
        assert "needs a GPU reset" in res[a.uid].error or "reset" in res[a.uid].error
        assert "nvidia-smi" in res[a.uid].error
        assert res[h.uid].error == ""  # Hopper: enabled on the fly
        assert n.backend.mig_enabled(n.gpu_uuid(1)) and not n.backend.mig_enabled(n.gpu_uuid(0))
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def _carve_foreign(n: Node, minor: int, profile_id: int, start: int) -> None:
    n.backend.carve(n.gpu_uuid(minor), profile_id, start)


@pytest.mark.parametrize("policy", list(ForeignPolicy))
def test_foreign_instances_by_policy(tmp_path: Path, policy: ForeignPolicy) -> None:
    n = open_node(tmp_path, [H100, H100], policy=policy)
    try:
        _carve_foreign(n, 0, 9, 0)  # 3g.40gb at 0, made by someone else
        n.start()
        assert len(n.p.checkpoint().foreign) == 1
        assert n.p.metrics.foreign_instances._value.get() == 1
        exact = n.claims.add("exact", [mig(n.backend, 0, 9, 0)])
        other = n.claims.add("other", [mig(n.backend, 0, 9, 4)])
        res = n.p.prepare([exact, other])
        if policy is ForeignPolicy.ADOPT:
            assert res[exact.uid].error == "" and res[other.uid].error == ""
            assert n.p.checkpoint().claims[exact.uid].devices[0].adopted
            assert n.p.checkpoint().foreign == ()
            n.p.unprepare([exact])  # adopted = carve's now: destroyed on unprepare
            assert n.instances() == [(0, 9, 4, 1)]
        elif policy is ForeignPolicy.LEAVE:
            assert "carve did not create" in res[exact.uid].error
            assert res[other.uid].error == ""
        else:
            assert "refused" in res[exact.uid].error and "refused" in res[other.uid].error
            assert set(n.p.refused_gpus()) == {n.gpu_uuid(0)}
        if policy is not ForeignPolicy.ADOPT:
            # restart: the foreign instance is still there, still recorded, never destroyed
            n.start()
            assert (0, 9, 0, 1) in n.instances()
            assert len(n.p.checkpoint().foreign) == 1
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_damaged_checkpoint_is_rebuilt_from_the_api_and_nvml(tmp_path: Path) -> None:
    """Issue 32, point 3(b). Before, the plugin started empty: the running pod's instance
    became foreign, its CDI spec was deleted as an orphan, and its claim kept this node's
    finalizer for good (Terminating after the pod went)."""
    n = open_node(tmp_path, [H100])
    try:
        n.start()
        ref = n.claims.add("c", [mig(n.backend, 0, 19, 0)])
        half = n.claims.add("half", [mig(n.backend, 0, 19, 1), mig(n.backend, 0, 19, 2)])
        assert all(r.error == "" for r in n.p.prepare([ref, half]).values())
        gi = n.p.checkpoint().claims[ref.uid].devices[0].gi_id
        gone = n.p.checkpoint().claims[half.uid].devices[1].gi_id
        assert gi is not None and gone is not None
        n.backend.destroy(n.gpu_uuid(0), gone)  # one of half's instances is gone meanwhile
        store = CheckpointStore(n.checkpoint_dir)
        store.path.write_text(store.path.read_text()[:40])
        n.start()  # must not raise
        assert list(n.checkpoint_dir.glob("checkpoint.json.corrupt-*"))
        rec = n.p.checkpoint().claims[ref.uid]
        assert rec.state is ClaimState.PREPARE_COMPLETED and rec.devices[0].gi_id == gi
        assert CdiWriterPath(n, ref.uid).exists()  # the running pod's spec is kept
        assert n.claims.finalizers(ref) == [f"{DRIVER}/node-{NODE}"]
        # half could not be rebuilt: its finalizer goes, its surviving instance is foreign
        assert half.uid not in n.p.checkpoint().claims and n.claims.finalizers(half) == []
        assert [f.placement_start for f in n.p.checkpoint().foreign] == [1]
        (event,) = [e for e in n.node_events if e[1] == "CheckpointRebuilt"]
        assert "1 prepared claim(s) recovered (default/c)" in event[2]
        assert "1 whose instances were gone released (default/half)" in event[2]
        assert n.p.unprepare([ref]) == {ref.uid: ""}  # and the pod's end releases it
        assert n.instances() == [(0, 19, 1, 1)] and n.claims.finalizers(ref) == []
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_carved_claim_deleted_without_a_consumer_is_torn_down(node: Node) -> None:
    """Issue 32, point 3(c): with carve before bind, a pod deleted after the carve and before
    its binding is never unprepared by the kubelet; its claim, being deleted with no consumer,
    waited for this node's finalizer for good."""
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 0)])
    assert node.p.prepare([ref])[ref.uid].error == ""
    node.p.retry_pending()  # still used: kept
    assert ref.uid in node.p.checkpoint().claims
    with node.claims.lock:
        node.claims.objects[("default", "c")]["status"]["reservedFor"] = []
    node.claims.delete(ref)  # Terminating: this node's finalizer holds it
    node.p.retry_pending()
    assert ref.uid not in node.p.checkpoint().claims and node.instances() == []
    assert node.claims.get("default", "c") is None  # the finalizer went, so the claim did


def test_checkpoint_file_is_readable_json_with_states(node: Node) -> None:
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 0)])
    node.p.prepare([ref])
    doc = json.loads((node.checkpoint_dir / "checkpoint.json").read_text())
    assert doc["data"]["claims"][ref.uid]["state"] == "PrepareCompleted"


class _Instrumented:
    """The real backend, counting NVML changes in flight per GPU (instrumentation, not a fake)."""

    def __init__(self, inner: Any, barrier: threading.Barrier | None = None) -> None:
        self._inner = inner
        self._barrier = barrier
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {}
        self.max_per_gpu = 0
        self.max_total = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _track(self, gpu: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.in_flight[gpu] = self.in_flight.get(gpu, 0) + 1
            self.max_per_gpu = max(self.max_per_gpu, self.in_flight[gpu])
            self.max_total = max(self.max_total, sum(self.in_flight.values()))
        try:
            if self._barrier is not None:
                self._barrier.wait(timeout=20)  # breaks unless two GPUs are in here at once
            else:
                time.sleep(0.005)  # widen the window for an overlap to show
            return fn(gpu, *args, **kwargs)
        finally:
            with self._lock:
                self.in_flight[gpu] -= 1

    def carve(self, gpu: str, *a: Any, **k: Any) -> Any:
        return self._track(gpu, self._inner.carve, *a, **k)

    def destroy(self, gpu: str, *a: Any, **k: Any) -> Any:
        return self._track(gpu, self._inner.destroy, *a, **k)


def _node_with(tmp_path: Path, wrapper: _Instrumented) -> Node:
    n = open_node(tmp_path, [H100, H100])
    wrapper._inner = n.backend
    n.backend = wrapper  # type: ignore[assignment]
    n.start()
    return n


def test_claims_on_different_gpus_carve_in_parallel(tmp_path: Path) -> None:
    wrapper = _Instrumented(None, threading.Barrier(2))
    n = _node_with(tmp_path, wrapper)
    try:
        a = n.claims.add("a", [mig(n.backend, 0, 19, 0)])
        b = n.claims.add("b", [mig(n.backend, 1, 19, 0)])
        res = n.p.prepare([a, b])
        assert res[a.uid].error == "" and res[b.uid].error == "", res
        assert wrapper.max_total == 2
    finally:
        n.p.close()
        wrapper._inner.close()
        sim.configure(None)


def test_one_gpu_is_never_changed_by_two_operations_at_once(tmp_path: Path) -> None:
    wrapper = _Instrumented(None)
    n = _node_with(tmp_path, wrapper)
    try:
        first = [n.claims.add(f"f{s}", [mig(n.backend, 0, 19, s)]) for s in range(3)]
        assert all(r.error == "" for r in n.p.prepare(first).values())
        second = [n.claims.add(f"s{s}", [mig(n.backend, 0, 19, s)]) for s in range(3, 7)]
        with ThreadPoolExecutor(2) as pool:
            up = pool.submit(n.p.prepare, second)
            down = pool.submit(n.p.unprepare, first)
            assert all(r.error == "" for r in up.result().values())
            assert set(down.result().values()) == {""}
        assert wrapper.max_per_gpu == 1
        assert len(n.instances()) == 4
    finally:
        n.p.close()
        wrapper._inner.close()
        sim.configure(None)


_H100_PROFILES = {19: range(7), 15: (0, 2, 4, 6), 14: (0, 2, 4), 9: (0, 4), 0: (0,)}
_device = st.tuples(st.integers(0, 1), st.sampled_from(sorted(_H100_PROFILES))).flatmap(
    lambda gp: st.sampled_from(list(_H100_PROFILES[gp[1]])).map(lambda s: (gp[0], gp[1], s))
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    claims=st.lists(st.lists(_device, min_size=1, max_size=2), min_size=1, max_size=5),
    ops=st.lists(
        st.tuples(st.sampled_from(["prepare", "unprepare", "restart"]), st.integers(0, 4)),
        max_size=14,
    ),
)
def test_random_operations_keep_checkpoint_nvml_and_cdi_in_agreement(
    claims: list[list[tuple[int, int, int]]], ops: list[tuple[str, int]]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        n = open_node(Path(d), [H100, H100])
        try:
            n.start()
            refs = [
                n.claims.add(f"c{i}", [mig(n.backend, g, p, s) for g, p, s in devs])
                for i, devs in enumerate(claims)
            ]
            prepared: set[str] = set()
            for op, i in ops:
                if op == "restart":
                    n.start()
                    continue
                ref = refs[i % len(refs)]
                if op == "prepare":
                    if n.p.prepare([ref])[ref.uid].error == "":
                        prepared.add(ref.uid)
                else:
                    assert n.p.unprepare([ref])[ref.uid] == ""
                    prepared.discard(ref.uid)
                _check_agreement(n, prepared)
        finally:
            n.p.close()
            n.backend.close()
            sim.configure(None)


def _check_agreement(n: Node, prepared: set[str]) -> None:
    cp = n.p.checkpoint()
    assert cp.foreign == ()
    assert set(cp.claims) == prepared
    assert all(r.state is ClaimState.PREPARE_COMPLETED for r in cp.claims.values())
    recorded = sorted(
        (d.gpu_uuid, d.gi_id, d.profile_id, d.placement_start)
        for r in cp.claims.values()
        for d in r.devices
    )
    live = sorted(
        (g.uuid, i.gi_id, i.profile_id, i.placement.start)
        for g in n.backend.gpus()
        if n.backend.mig_enabled(g.uuid)
        for i in n.backend.instances(g.uuid)
    )
    assert live == recorded  # every instance owned once, every owned instance alive
    specs = {p.name for p in n.cdi_root.iterdir()} if n.cdi_root.exists() else set()
    assert specs == {f"{DRIVER}-claim_{uid}.json" for uid in prepared}
    for rec in cp.claims.values():
        assert n.claims.finalizers(ClaimRef(rec.namespace, rec.name, rec.uid)) == [
            f"{DRIVER}/node-{NODE}"
        ]


def test_reboot_forgets_lost_instances_and_prepare_carves_again(node: Node) -> None:
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 2)])
    first = node.p.prepare([ref])[ref.uid]
    assert first.error == ""
    sim.sim_reboot()  # every instance is gone; Hopper comes back with MIG off
    node.start()
    assert node.p.checkpoint().claims == {}
    assert not CdiWriterPath(node, ref.uid).exists()
    assert node.claims.finalizers(ref) == []
    again = node.p.prepare([ref])[ref.uid]
    assert again.error == "" and node.instances() == [(0, 19, 2, 1)]
    new_uuid = node.p.checkpoint().claims[ref.uid].devices[0].mig_uuid
    env = cdi.resolve([node.cdi_root], again.devices[0].cdi_device_ids).env
    assert f"NVIDIA_VISIBLE_DEVICES={new_uuid}" in env


def test_housekeeping_releases_claims_removed_behind_the_kubelets_back(node: Node) -> None:
    kept = node.claims.add("kept", [mig(node.backend, 0, 19, 0)])
    gone = node.claims.add("gone", [mig(node.backend, 0, 19, 1)])
    recreated = node.claims.add("again", [mig(node.backend, 1, 19, 0)])
    assert all(r.error == "" for r in node.p.prepare([kept, gone, recreated]).values())
    del node.claims.objects[("default", "gone")]  # finalizer stripped and deleted by hand
    node.claims.objects[("default", "again")]["metadata"]["uid"] = "a-new-uid"
    node.p.retry_pending()
    assert set(node.p.checkpoint().claims) == {kept.uid}
    assert node.instances() == [(0, 19, 0, 1)]
    assert node.claims.finalizers(kept) == [f"{DRIVER}/node-{NODE}"]
