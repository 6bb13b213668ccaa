"""Which MIG device a pod got, on the claim (issue 31, point 3), through the real apiserver:
the node server-side-applies it into the claim's status.devices, where `kubectl describe
resourceclaim` shows it, and it is the UUID the container was given."""

from __future__ import annotations

import pytest

from devcluster.waiting import wait_for
from tests.e2e.harness import E2E, profile_is, request

pytestmark = pytest.mark.cluster


def test_the_claim_names_the_mig_device_the_container_got(e2e: E2E) -> None:
    e2e.node("report", "A100-SXM4-40GB")
    e2e.template("one-3g", [request("mig", [profile_is("3g.20gb")])])
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "one-3g"}})
    e2e.wait_phase("p", "Running")

    def data() -> dict[str, object] | None:
        claim = e2e.claim_of("p", "mig")
        entries = (claim.get("status") or {}).get("devices") or []
        got = [e.get("data") for e in entries if e.get("driver") == e2e.stack.contract.driver]
        return got[0] if got and got[0] else None

    told = wait_for("the device's data on the claim", data, timeout=30)
    assert told["kind"] == "PreparedDevice" and told["profile"] == "3g.20gb"
    env = dict(v.split("=", 1) for v in e2e.container_env("p"))
    assert env["NVIDIA_VISIBLE_DEVICES"] == told["migUUID"]
    described = e2e.describe(e2e.claim_of("p", "mig")["metadata"]["name"], "resourceclaim")
    assert str(told["migUUID"]) in described, described
    e2e.delete_pod("p")
    e2e.wait_gone("p")
