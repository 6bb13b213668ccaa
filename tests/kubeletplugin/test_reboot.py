"""After a reboot, MIG instances are matched by identity (MIG UUID and the boot they were carved
in), never by GI id: an instance a boot-time agent re-created at a claim's placement has the same
GI id but is not the claim's (issue 45, item A).

The node harness runs the real preparer on the simulator; `sim.sim_reboot` is the reboot (a new
boot ID in the fake /proc, every instance gone) and `sim.sim_boot_layout` the boot-time layout
agent (nvidia-mig-manager, a systemd unit, an admin) that runs before the plugin starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from driver import cdi
from driver.nvml import sim
from driver.nvml.sim import LayoutInstance
from kubeletplugin.checkpoint import (
    FILE_NAME,
    CheckpointStore,
    CheckpointVersionError,
    ClaimRecord,
    ClaimState,
    v1,
)
from kubeletplugin.foreign import ForeignPolicy
from kubeletplugin.ports import ClaimRef
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, open_node, started_node

H100 = "H100-SXM5-80GB"
ONE_G = 19  # 1g.10gb on the H100
FINALIZER = f"{DRIVER}/node-{NODE}"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with started_node(tmp_path, [H100]) as n:
        yield n


def _specs_text(n: Node) -> str:
    """Every CDI spec on the node, as one text (to look for a MIG UUID anywhere in them)."""
    if not n.cdi_root.exists():
        return ""
    return "\n".join(p.read_text() for p in sorted(n.cdi_root.iterdir()))


def _prepared(n: Node, name: str, start: int) -> tuple[ClaimRef, str, int]:
    """A claim prepared on GPU 0 at `start`: its ref, MIG UUID and GI id."""
    ref = n.claims.add(name, [mig(n.backend, 0, ONE_G, start)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    (d,) = n.p.checkpoint().claims[ref.uid].devices
    assert d.mig_uuid is not None and d.gi_id is not None
    return ref, d.mig_uuid, d.gi_id


def _live(n: Node) -> dict[int, str | None]:
    gpu = n.gpu_uuid(0)
    if not n.backend.mig_enabled(gpu):
        return {}
    return {i.gi_id: i.mig_uuid for i in n.backend.instances(gpu)}


def test_an_instance_recreated_at_boot_is_foreign_not_the_claims(node: Node) -> None:
    ref, old_uuid, gi_id = _prepared(node, "c", 3)
    sim.sim_reboot()
    (new_uuid,) = sim.sim_boot_layout([LayoutInstance(0, ONE_G, 3)])
    assert _live(node) == {gi_id: new_uuid}  # same GI id, another instance

    node.start()  # the plugin comes back after the reboot

    cp = node.p.checkpoint()
    assert ref.uid not in cp.claims  # released as "instances all vanished"
    assert node.claims.finalizers(ref) == []
    assert [(f.gi_id, f.placement_start) for f in cp.foreign] == [(gi_id, 3)]  # foreign
    assert any(r == "ForeignMigInstance" and f"GI {gi_id}" in m for _, r, m in node.node_events)
    assert old_uuid not in _specs_text(node)  # no spec names the stale MIG UUID
    # the kubelet prepares the claim again (its pod restarts): carve never adopts it (policy
    # leave) and never destroys it
    again = node.p.prepare([ref])[ref.uid]
    assert "carve did not create" in again.error, again.error
    assert old_uuid not in _specs_text(node) and new_uuid not in _specs_text(node)
    node.p.unprepare([ref])
    node.p.retry_pending()
    assert _live(node) == {gi_id: new_uuid}


def test_under_policy_adopt_a_new_prepare_gets_the_new_mig_uuid(tmp_path: Path) -> None:
    n = open_node(tmp_path, [H100], policy=ForeignPolicy.ADOPT)
    try:
        n.start()
        ref, old_uuid, _ = _prepared(n, "c", 3)
        sim.sim_reboot()
        (new_uuid,) = sim.sim_boot_layout([LayoutInstance(0, ONE_G, 3)])
        n.start()
        assert ref.uid not in n.p.checkpoint().claims  # never adopted as the old claim's own
        again = n.p.prepare([ref])[ref.uid]  # adoption of a foreign instance, as configured
        assert again.error == ""
        env = cdi.resolve([n.cdi_root], again.devices[0].cdi_device_ids).env
        assert f"NVIDIA_VISIBLE_DEVICES={new_uuid}" in env
        assert old_uuid not in _specs_text(n)
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def test_a_half_prepared_claim_of_an_earlier_boot_destroys_nothing(node: Node) -> None:
    """A crash between PREPARE_STARTED and the carve's save, then a reboot: looking for the
    claim's instance by its intent would find the boot agent's instance at that placement."""
    ref = node.claims.add("c", [mig(node.backend, 0, ONE_G, 5)])
    plan = node.p.prepare([ref])  # a claim carved and then...
    assert plan[ref.uid].error == ""
    rec = node.p.checkpoint().claims[ref.uid]
    # ...as the crash left it: intent recorded, no instance id saved
    intent = tuple(replace(d, gi_id=None, ci_id=None, mig_uuid=None) for d in rec.devices)
    node.p.ledger.put(replace(rec, state=ClaimState.PREPARE_STARTED, devices=intent))
    sim.sim_reboot()
    (new_uuid,) = sim.sim_boot_layout([LayoutInstance(0, ONE_G, 5)])

    node.start()

    assert ref.uid not in node.p.checkpoint().claims
    assert list(_live(node).values()) == [new_uuid]  # not destroyed
    assert len(node.p.checkpoint().foreign) == 1


def test_a_restart_in_the_middle_still_knows_the_claim_is_of_the_earlier_boot(
    node: Node,
) -> None:
    """The release after a reboot fails (the API is down): the record is kept, and a plugin
    restarted in the same boot still takes nothing live for the claim's."""
    ref, old_uuid, gi_id = _prepared(node, "c", 3)
    sim.sim_reboot()
    (new_uuid,) = sim.sim_boot_layout([LayoutInstance(0, ONE_G, 3)])
    node.claims.fail_finalizer_removal = True

    node.start()
    assert ref.uid in node.p.checkpoint().claims  # the record is never lost
    node.start()  # and again, in the same boot
    cp = node.p.checkpoint()
    assert cp.claims[ref.uid].state is ClaimState.UNPREPARE_STARTED
    assert [f.gi_id for f in cp.foreign] == [gi_id]
    assert old_uuid not in _specs_text(node)
    res = node.p.prepare([ref])[ref.uid]  # the kubelet asks: no stale CDI IDs come back
    assert res.error and not res.devices

    node.claims.fail_finalizer_removal = False
    node.p.retry_pending()
    assert ref.uid not in node.p.checkpoint().claims
    assert node.claims.finalizers(ref) == []
    assert _live(node) == {gi_id: new_uuid}


def test_in_one_boot_an_instance_replaced_while_the_plugin_was_down_is_not_destroyed(
    node: Node,
) -> None:
    """Identity, not GI id, even without a reboot: an admin destroys carve's instance and
    creates another at the same placement while the plugin is down."""
    ref, old_uuid, gi_id = _prepared(node, "c", 3)
    node.p.close()
    gpu = node.gpu_uuid(0)
    node.backend.destroy(gpu, gi_id)
    replaced = node.backend.carve(gpu, ONE_G, 3)
    assert replaced.gi_id == gi_id and replaced.mig_uuid != old_uuid

    node.start()

    assert ref.uid not in node.p.checkpoint().claims
    assert _live(node) == {gi_id: replaced.mig_uuid}
    assert [f.gi_id for f in node.p.checkpoint().foreign] == [gi_id]
    assert old_uuid not in _specs_text(node)


def test_a_checkpoint_from_a_newer_release_is_still_refused_after_a_reboot(node: Node) -> None:
    ref, _, _ = _prepared(node, "c", 3)
    node.p.close()
    path = node.checkpoint_dir / FILE_NAME
    doc = json.loads(path.read_bytes())
    future = json.dumps({**doc, "version": 99}).encode()
    path.write_bytes(future)
    sim.sim_reboot()
    with pytest.raises(CheckpointVersionError, match="format version 99"):
        node.start()
    assert path.read_bytes() == future  # untouched, for the release that reads it
    assert node.claims.finalizers(ref) == [FINALIZER]


def test_a_damaged_checkpoint_after_a_reboot_adopts_no_boot_time_instance(node: Node) -> None:
    """The rebuild from the API and NVML would take the boot agent's instance for the claim's
    own; the damaged file still says which boot wrote it, and that one is over."""
    ref, old_uuid, gi_id = _prepared(node, "c", 3)
    node.p.close()
    path = node.checkpoint_dir / FILE_NAME
    doc = json.loads(path.read_bytes())
    doc["checksum"] = "sha256:" + "0" * 64  # damaged
    path.write_text(json.dumps(doc))
    sim.sim_reboot()
    (new_uuid,) = sim.sim_boot_layout([LayoutInstance(0, ONE_G, 3)])

    node.start()

    assert list(node.checkpoint_dir.glob(f"{FILE_NAME}.corrupt-*"))  # kept, never deleted
    assert ref.uid not in node.p.checkpoint().claims
    assert node.claims.finalizers(ref) == []  # released
    assert _live(node) == {gi_id: new_uuid}
    assert [f.gi_id for f in node.p.checkpoint().foreign] == [gi_id]
    assert any(r == "CheckpointRebuilt" for _, r, _ in node.node_events)
    assert old_uuid not in _specs_text(node) and new_uuid not in _specs_text(node)


def test_a_checkpoint_written_before_boot_ids_reads_and_is_stamped(node: Node) -> None:
    """An older release's file (no boot ID) is taken to be of this boot; the next reboot is
    then told apart."""
    ref, _, gi_id = _prepared(node, "c", 3)
    node.p.close()
    store = CheckpointStore(node.checkpoint_dir)
    cp = store.load()
    unknown = {uid: replace(r, boot_id=None) for uid, r in cp.claims.items()}
    store.save(replace(cp, boot_id=None, claims=unknown))
    assert b"bootID" not in (node.checkpoint_dir / FILE_NAME).read_bytes()

    node.start()
    rec: ClaimRecord = node.p.checkpoint().claims[ref.uid]
    assert rec.state is ClaimState.PREPARE_COMPLETED  # kept: same boot, same MIG UUID
    assert rec.boot_id == sim.sim_boot_id() == node.p.checkpoint().boot_id
    assert v1.decode(json.loads((node.checkpoint_dir / FILE_NAME).read_bytes())).boot_id == (
        sim.sim_boot_id()
    )
    sim.sim_reboot()
    sim.sim_boot_layout([LayoutInstance(0, ONE_G, 3)])
    node.start()
    assert ref.uid not in node.p.checkpoint().claims
    assert [f.gi_id for f in node.p.checkpoint().foreign] == [gi_id]
