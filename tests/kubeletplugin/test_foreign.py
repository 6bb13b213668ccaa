"""MIG instances carve did not create (kubeletplugin.foreign, and how the preparer finds them).

Issue 32, point 1: an instance created by someone else while the plugin runs must never be
handed to a claim, never be destroyed by carve, and must make the devices it blocks unusable
in what the node publishes (tainted), with a stuck claim's device tainted for eviction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.nvml import sim
from driver.nvml.errors import PlacementTaken
from kubeletplugin.checkpoint import ForeignInstance
from kubeletplugin.foreign import WHOLE_GPU, ForeignPolicy, blocked_places, foreign_taints
from tests.kubeletplugin.node_harness import DRIVER, Node, mig, open_node

A100 = "A100-SXM4-40GB"
KEY = f"{DRIVER}/foreign-instance"
P3G = 9  # 3g.20gb on an A100-40GB: placements 0 and 4
P1G = 19  # 1g.5gb on an A100-40GB: placements 0..6


@pytest.fixture
def a100(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [A100])
    n.start()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _gi_at(n: Node, profile_id: int, start: int) -> int:
    return next(
        i.gi_id
        for i in n.backend.instances(n.gpu_uuid(0))
        if (i.profile_id, i.placement.start) == (profile_id, start)
    )


def test_an_instance_made_while_the_plugin_runs_is_never_handed_to_a_claim(a100: Node) -> None:
    """The reported break of invariant 2: the first prepare was refused, its rollback destroyed
    the foreign instance as if it were its own half-made carve, and the kubelet's retry carved
    the placement afresh for the claim."""
    n = a100
    n.backend.carve(n.gpu_uuid(0), P3G, 4)  # an admin's `nvidia-smi mig -cgi`
    theirs = _gi_at(n, P3G, 4)
    ref = n.claims.add("late", [mig(n.backend, 0, P3G, 4)])
    for _attempt in range(3):  # the kubelet retries
        error = n.p.prepare([ref])[ref.uid].error
        assert "carve did not create" in error and f"GI {theirs}" in error
        assert f"{KEY}:NoExecute" in error
    assert _gi_at(n, P3G, 4) == theirs  # never destroyed, never recreated
    assert ref.uid not in n.p.checkpoint().claims
    assert [(f.gi_id, f.placement_start) for f in n.p.checkpoint().foreign] == [(theirs, 4)]
    assert n.p.foreign.stuck_places(n.gpu_uuid(0)) == {(P3G, 4)}
    (warning,) = [e for e in n.node_events if e[1] == "ForeignMigInstance"]
    assert warning[0] == "Warning" and f"GI {theirs} (3g.20gb, memory slices 4-7)" in warning[2]
    # the other half of the GPU is still carve's to give
    other = n.claims.add("early", [mig(n.backend, 0, P3G, 0)])
    assert n.p.prepare([other])[other.uid].error == ""


def test_housekeeping_finds_an_instance_and_notices_when_it_goes(a100: Node) -> None:
    n = a100
    uuid = n.gpu_uuid(0)
    mine = n.claims.add("mine", [mig(n.backend, 0, P1G, 0)])
    assert n.p.prepare([mine])[mine.uid].error == ""
    before = n.offers_changed
    n.backend.carve(uuid, P1G, 6)
    theirs = _gi_at(n, P1G, 6)
    n.p.retry_pending()  # periodic housekeeping
    assert [f.gi_id for f in n.p.checkpoint().foreign] == [theirs]  # not the claim's own
    assert n.offers_changed > before  # republished with the taints
    assert [e[1] for e in n.node_events] == ["ForeignMigInstance"]
    n.p.retry_pending()  # nothing new: no second event
    assert len(n.node_events) == 1

    n.backend.destroy(uuid, theirs)
    n.p.retry_pending()
    assert n.p.checkpoint().foreign == ()
    assert n.node_events[-1][:2] == ("Normal", "ForeignMigInstanceGone")
    assert mine.uid in n.p.checkpoint().claims  # carve's own instance untouched throughout


def test_refuse_gpu_applies_to_an_instance_found_later_and_lifts_when_it_goes(
    tmp_path: Path,
) -> None:
    n = open_node(tmp_path, [A100], policy=ForeignPolicy.REFUSE_GPU)
    try:
        n.start()
        uuid = n.gpu_uuid(0)
        n.backend.carve(uuid, P1G, 6)
        n.p.retry_pending()
        assert set(n.p.refused_gpus()) == {uuid}
        ref = n.claims.add("c", [mig(n.backend, 0, P1G, 0)])
        assert "is refused" in n.p.prepare([ref])[ref.uid].error
        assert n.p.foreign.stuck_places(uuid) == {(P1G, 0)}
        n.backend.destroy(uuid, _gi_at(n, P1G, 6))
        n.p.retry_pending()
        assert n.p.refused_gpus() == {} and n.p.foreign.stuck_places(uuid) == frozenset()
        assert n.p.prepare([ref])[ref.uid].error == ""
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_an_instance_the_checkpoint_cannot_record_is_destroyed_at_once(
    a100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollback no longer looks for unrecorded instances by intent (that search took the
    foreign instance for its own), so a carve whose save fails must be undone on the spot."""
    n = a100
    store = n.p.ledger._store  # the one seam: a disk that fails once
    real_save = store.save
    failed = []

    def save(cp: Any) -> None:
        carved = any(d.gi_id is not None for r in cp.claims.values() for d in r.devices)
        if carved and not failed:
            failed.append(True)
            raise OSError(28, "No space left on device")
        real_save(cp)

    monkeypatch.setattr(store, "save", save)
    ref = n.claims.add("c", [mig(n.backend, 0, P3G, 0)])
    assert "No space left on device" in n.p.prepare([ref])[ref.uid].error
    assert failed and n.instances() == []
    assert ref.uid not in n.p.checkpoint().claims
    assert n.p.prepare([ref])[ref.uid].error == ""  # the kubelet's retry carves cleanly


def test_adopt_takes_over_an_instance_that_appeared_later(tmp_path: Path) -> None:
    n = open_node(tmp_path, [A100], policy=ForeignPolicy.ADOPT)
    try:
        n.start()
        n.backend.carve(n.gpu_uuid(0), P3G, 4)
        theirs = _gi_at(n, P3G, 4)
        ref = n.claims.add("c", [mig(n.backend, 0, P3G, 4)])
        assert n.p.prepare([ref])[ref.uid].error == ""
        (d,) = n.p.checkpoint().claims[ref.uid].devices
        assert d.adopted and d.gi_id == theirs
        assert (
            n.p.checkpoint().foreign == ()
            and n.p.foreign.stuck_places(n.gpu_uuid(0)) == frozenset()
        )
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


# --- what the node publishes (pure) -----------------------------------------------------


def _foreign(uuid: str, gi_id: int, profile_id: int, start: int, size: int) -> ForeignInstance:
    return ForeignInstance(uuid, gi_id, profile_id, start, size, (0,), 0.0)


def _model(n: Node) -> Any:
    return n.backend.gpu_model(n.gpu_uuid(0))


def test_taints_by_policy(a100: Node) -> None:
    model, uuid = _model(a100), a100.gpu_uuid(0)
    found = [_foreign(uuid, 2, P3G, 4, 4)]
    every = {(p.id, s) for p in model.profiles for s in p.starts}

    leave = foreign_taints(model, found, policy=ForeignPolicy.LEAVE, key=KEY)
    assert (P3G, 4) in leave.devices and (P3G, 0) not in leave.devices
    assert (P1G, 3) not in leave.devices and (P1G, 4) in leave.devices
    assert leave.whole == ({"key": KEY, "value": "gi-2", "effect": "NoSchedule"},)
    assert {t["effect"] for ts in leave.devices.values() for t in ts} == {"NoSchedule"}

    adopt = foreign_taints(model, found, policy=ForeignPolicy.ADOPT, key=KEY)
    assert set(adopt.devices) == set(leave.devices) - {(P3G, 4)}

    refuse = foreign_taints(model, found, policy=ForeignPolicy.REFUSE_GPU, key=KEY)
    assert set(refuse.devices) == every

    stuck = foreign_taints(
        model, found, policy=ForeignPolicy.LEAVE, key=KEY, stuck={(P3G, 4), WHOLE_GPU}
    )
    assert stuck.devices[(P3G, 4)][0]["effect"] == "NoExecute"
    assert stuck.devices[(P1G, 4)][0]["effect"] == "NoSchedule"
    assert stuck.whole[0]["effect"] == "NoExecute"
    assert not foreign_taints(model, [], policy=ForeignPolicy.REFUSE_GPU, key=KEY)


@pytest.mark.parametrize("model_name", [A100, "A30-24GB"])  # H100's table is A100's, larger
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_a_device_is_blocked_exactly_when_nvml_refuses_to_carve_it(
    tmp_path_factory: pytest.TempPathFactory, model_name: str, data: st.DataObject
) -> None:
    """Against the simulator's NVML rules (memory slices, engines, instance limits): with
    random foreign instances on a GPU, every device `blocked_places` leaves free can be carved
    and every device it blocks is refused."""
    n = open_node(tmp_path_factory.mktemp("f"), [model_name])
    try:
        uuid = n.gpu_uuid(0)
        model = n.backend.gpu_model(uuid)
        n.backend.enable_mig(uuid)
        places = [(p.id, s) for p in model.profiles for s in p.starts]
        for pid, start in data.draw(st.lists(st.sampled_from(places), max_size=4)):
            with contextlib.suppress(PlacementTaken):
                n.backend.carve(uuid, pid, start)
        found = [
            _foreign(uuid, i.gi_id, i.profile_id, i.placement.start, i.placement.size)
            for i in n.backend.instances(uuid)
        ]
        blocked = blocked_places(model, found)
        for pid, start in places:
            try:
                carved = n.backend.carve(uuid, pid, start)
            except PlacementTaken:
                assert (pid, start) in blocked, (pid, start, found)
            else:
                assert (pid, start) not in blocked, (pid, start, found)
                n.backend.destroy(uuid, carved.gi_id)
    finally:
        n.backend.close()
        sim.configure(None)
