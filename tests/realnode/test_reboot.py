"""A real node reboots under a running MIG claim (issue 45, item 3, the real-node tier).

Everything of the node dies (containerd, the kubelet, the pod's container, carve's plugin);
tmpfs goes (containerd's state, the CDI specs); the disks stay (the kubelet's and carve's
checkpoints). The simulated GPUs come back empty under a new boot ID, and a boot-time layout
agent re-creates an instance at the claim's placement before the node's units start. The real
kubelet and containerd then meet carve's plugin again: the claim of the earlier boot is
released, no CDI spec names its MIG UUID, the re-created instance is foreign (a Node event)
and carve never destroys it, and the kubelet's unprepare of the pod, once deleted, succeeds.
Before boot IDs and identity matching, the plugin adopted the re-created instance as the
claim's and wrote its UUID into the claim's CDI spec.
"""

from __future__ import annotations

from devcluster.waiting import wait_for
from driver.naming import parse_device_name
from driver.nvml import sim
from driver.nvml.sim import LayoutInstance
from kubeletplugin.checkpoint import FILE_NAME, decode
from tests.e2e.harness import destroy_as_the_admin, profile_is, request
from tests.realnode.harness import NODE_A, RealEnv


def test_a_reboot_under_a_claim_releases_it_and_leaves_the_boot_layout_alone(
    env: RealEnv,
) -> None:
    env.template("one-1g", [request("mig", [profile_is("1g.5gb")])])
    env.pod("p", {"mig": {"resourceClaimTemplateName": "one-1g"}}, node=NODE_A, sleep=600)
    env.wait_phase("p", "Running", timeout=90)
    claim = env.claim_of("p", "mig")
    uid = claim["metadata"]["uid"]
    (result,) = env.results(claim)
    place = parse_device_name(result["device"])
    assert place.profile_id is not None and place.placement_start is not None
    node = env.node_of(NODE_A)
    checkpoint = node.layout.plugins_dir / node.driver / FILE_NAME
    (device,) = decode(checkpoint.read_bytes()).claims[uid].devices
    old_uuid = device.mig_uuid
    assert old_uuid
    recreated: list[str] = []

    def the_gpus_reboot() -> None:
        sim.configure(node.layout.sim_config)
        try:
            sim.sim_reboot()
            recreated.extend(
                sim.sim_boot_layout(
                    [LayoutInstance(place.minor, place.profile_id, place.placement_start)]
                )
            )
        finally:
            sim.configure(None)

    try:
        node.reboot(env.real.archives, while_down=the_gpus_reboot)
        (new_uuid,) = recreated
        finalizer = env.stack.contract.node_finalizer(node.name)
        wait_for(
            "the claim of the earlier boot released by the node",
            lambda: finalizer not in (env.claim_of("p", "mig")["metadata"].get("finalizers") or ()),
            timeout=90,
        )
        # The finalizer goes first, then the record: wait for the save too.
        wait_for(
            "the claim gone from the checkpoint",
            lambda: uid not in decode(checkpoint.read_bytes()).claims,
            timeout=30,
        )
        specs = "".join(p.read_text() for p in node.layout.cdi_dir.glob("*.json"))
        assert old_uuid not in specs  # no spec names the MIG UUID of the earlier boot
        wait_for(
            "a ForeignMigInstance event on the Node",
            lambda: env.node_events(node.name, "ForeignMigInstance"),
        )
        assert _live(env) == [new_uuid]

        env.delete_pod("p")  # the kubelet's unprepare meets a claim the plugin already let go
        env.wait_gone("p", timeout=120)
        assert _live(env) == [new_uuid]  # never destroyed by carve
    finally:
        # so that the node ends empty, as the teardown checks
        destroy_as_the_admin(env.node_of(NODE_A).layout.sim_config)


def _live(env: RealEnv) -> list[str | None]:
    hw = env.node_of(NODE_A).hardware()
    return [ci["uuid"] for g in hw["gpus"] for gi in g["gis"] for ci in gi["cis"]]
