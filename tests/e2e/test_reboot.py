"""A node reboots under a running MIG claim, and a boot-time layout agent re-creates the
claim's instance at the same placement before the plugin starts (issue 45, item A): the
plugin releases the claim (its instance died with the boot), records the re-created instance as
foreign (a Node event; its devices tainted), never writes its old MIG UUID into a CDI spec, and
never destroys the instance it did not create, on carve's real processes and control plane."""

from __future__ import annotations

from devcluster.waiting import wait_for
from driver.naming import parse_device_name
from driver.nvml import sim
from driver.nvml.sim import LayoutInstance
from kubeletplugin.checkpoint import FILE_NAME, decode
from tests.e2e.harness import E2E, destroy_as_the_admin, profile_is, request


def test_a_mig_claim_after_a_reboot_is_released_and_the_recreated_instance_is_foreign(
    e2e: E2E,
) -> None:
    node = e2e.node("reboot", "H100-SXM5-80GB")
    e2e.template("slice", [request("gpu", [profile_is("1g.10gb")])])
    e2e.pod("p", {"gpu": {"resourceClaimTemplateName": "slice"}})
    e2e.wait_phase("p", "Running")
    claim = e2e.claim_of("p", "gpu")
    uid = claim["metadata"]["uid"]
    (result,) = e2e.results(claim)
    place = parse_device_name(result["device"])
    assert place.profile_id is not None and place.placement_start is not None
    checkpoint = node.plugins_dir / node.driver / FILE_NAME
    (device,) = decode(checkpoint.read_bytes()).claims[uid].devices
    old_uuid = device.mig_uuid
    assert old_uuid

    node.kill_plugin()
    sim.configure(node.sim_config)
    try:
        sim.sim_reboot()
        (new_uuid,) = sim.sim_boot_layout(
            [LayoutInstance(place.minor, place.profile_id, place.placement_start)]
        )
    finally:
        sim.configure(None)
    for spec in node.cdi_dir.glob("*.json"):
        spec.unlink()  # /var/run/cdi is a tmpfs
    node.start_plugin()
    node.wait_plugin_ready()

    finalizer = e2e.stack.contract.node_finalizer(node.name)
    wait_for(
        "the claim released by the node",
        lambda: finalizer not in (e2e.claim_of("p", "gpu")["metadata"].get("finalizers") or ()),
        timeout=60,
    )
    # The finalizer goes first, then the record: wait for the save too.
    wait_for(
        "the claim gone from the checkpoint",
        lambda: uid not in decode(checkpoint.read_bytes()).claims,
        timeout=30,
    )
    specs = "".join(p.read_text() for p in node.cdi_dir.glob("*.json"))
    assert old_uuid not in specs  # no spec names the MIG UUID of the earlier boot

    taint_key = e2e.stack.contract.foreign_instance_taint_key

    def tainted() -> bool:
        d = e2e.published_device(node.name, result["device"])
        return any(t.get("key") == taint_key for t in d.get("taints") or ())

    wait_for("the re-created instance's device tainted", tainted, timeout=60)

    wait_for(
        "a ForeignMigInstance event on the Node",
        lambda: e2e.node_events(node.name, "ForeignMigInstance"),
        timeout=60,
    )

    def live() -> list[str | None]:
        hw = node.hardware()
        return [ci["uuid"] for g in hw["gpus"] for gi in g["gis"] for ci in gi["cis"]]

    assert live() == [new_uuid]
    e2e.delete_pod("p")
    e2e.wait_gone("p")
    wait_for(
        "the claim gone",
        lambda: not [c for c in e2e.all_claims() if c["metadata"]["uid"] == uid],
        timeout=60,
    )
    assert live() == [new_uuid]  # never destroyed by carve
    destroy_as_the_admin(node.sim_config, place.minor)  # so that the node ends empty
