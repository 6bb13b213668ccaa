"""A damaged checkpoint, through the real controller (issue 32, point 3(b)).

Before, with the checkpoint truncated under two running pods and the plugin restarted, the
plugin started empty: it deleted the pods' CDI specs as orphans, kept their instances as
foreign, and deleting one pod left its claim Terminating, with the controller's and this
node's finalizers, for good.
"""

from __future__ import annotations

import pytest

from devcluster.waiting import wait_for
from tests.e2e.harness import E2E, profile_is, request

pytestmark = pytest.mark.cluster


def test_a_truncated_checkpoint_is_rebuilt_and_nothing_is_left_behind(e2e: E2E) -> None:
    node = e2e.node("cpd", "A100-SXM4-40GB")
    e2e.template("one-3g", [request("mig", [profile_is("3g.20gb")])])
    for name in ("a", "b"):
        e2e.pod(name, {"mig": {"resourceClaimTemplateName": "one-3g"}})
        e2e.wait_phase(name, "Running")
    claim_a = e2e.claim_of("a", "mig")["metadata"]["name"]
    uid_b = e2e.claim_of("b", "mig")["metadata"]["uid"]
    node.kill_plugin()
    checkpoint = node.plugins_dir / node.driver / "checkpoint.json"
    checkpoint.write_bytes(checkpoint.read_bytes()[:40])  # a torn write, a full disk
    node.start_plugin()
    node.wait_plugin_ready()
    described = wait_for(
        "the node's CheckpointRebuilt event",
        lambda: (
            t
            if "CheckpointRebuilt" in (t := e2e.stack.kubectl("describe", "node", node.name).stdout)
            else None
        ),
        timeout=60,
    )
    assert "2 prepared claim(s) recovered" in described, described
    assert (node.cdi_dir / f"{node.driver}-claim_{uid_b}.json").exists()  # b's spec is kept

    e2e.delete_pod("a")
    e2e.wait_gone("a")
    wait_for(
        "pod a's claim to be gone (no finalizer left behind)",
        lambda: all(c["metadata"]["name"] != claim_a for c in e2e.claims()),
        timeout=60,
    )
    wait_for("only b's instance left", lambda: e2e.instance_count() == 1, timeout=60)
    assert e2e.check_invariants() == []
    pod_b = e2e.raw_pod("b")
    assert pod_b is not None and pod_b["status"]["phase"] == "Running"
