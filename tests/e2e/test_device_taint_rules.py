"""An admin's DeviceTaintRule on the real control plane (issue 31, point 1): a real
``resource.k8s.io/v1`` DeviceTaintRule with ``NoSchedule`` on one node's GPU keeps carve's
controller from handing its devices to a claim that does not tolerate the taint (the pod waits,
its condition and events naming the rule, `carve status` showing it), a claim that tolerates it
gets the GPU, and deleting the rule lets the waiting pod run there.

The rule is cluster-scoped, so it selects only this test's node (its pool) and is deleted even
when the test fails; other tests share the control plane and the controller.
"""

from __future__ import annotations

import io

import pytest
from kubernetes.client.exceptions import ApiException

from carvecli.main import main as carve_cli
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from tests.e2e.harness import E2E, profile_is, request

pytestmark = pytest.mark.cluster

KEY = "example.com/maintenance"


def _rule(name: str, driver: str, pool: str) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": driver, "pool": pool},
            "taint": {"key": KEY, "value": "disk", "effect": "NoSchedule"},
        },
    }


def _placed_condition(e2e: E2E, pod: str) -> Obj | None:
    got = e2e.raw_pod(pod) or {}
    kind = e2e.stack.contract.placed_condition
    return next((c for c in got["status"].get("conditions") or [] if c["type"] == kind), None)


def _status(e2e: E2E) -> str:
    out = io.StringIO()
    assert carve_cli(["status", "--kubeconfig", str(e2e.stack.kubeconfig)], out) == 0
    return out.getvalue()


def _delete_rule(e2e: E2E, name: str) -> None:
    try:
        e2e.resource.delete_device_taint_rule(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def test_a_no_schedule_rule_keeps_untolerating_claims_off_until_it_is_deleted(
    e2e: E2E,
) -> None:
    driver = e2e.stack.contract.driver
    name = f"{e2e.group}-maint"
    pool = f"{e2e.group}-gpu"  # carve names a node's pool after the node
    # The rule exists before the node publishes: the controller has it long before the slices.
    e2e.resource.create_device_taint_rule(_rule(name, driver, pool))
    try:
        node = e2e.node("gpu", "A100-SXM4-40GB")
        assert node.name == pool
        e2e.template("plain", [request("mig", [profile_is("1g.5gb")])])
        tolerant = request("mig", [profile_is("1g.5gb")])
        tolerant["exactly"]["tolerations"] = [
            {"key": KEY, "operator": "Exists", "effect": "NoSchedule"}
        ]
        e2e.template("tolerant", [tolerant])

        e2e.pod("waits", {"mig": {"resourceClaimTemplateName": "plain"}})
        cond = wait_for(
            "carve's condition on the waiting pod",
            lambda: _placed_condition(e2e, "waits"),
            timeout=30,
        )
        named = f"{KEY}=disk:NoSchedule from DeviceTaintRule {name}"
        assert cond["status"] == "False" and named in cond["message"], cond
        claim = e2e.claim_of("waits", "mig")
        assert not e2e.results(claim)
        wait_for(  # events have their own writer: it may land after the condition
            "the taint named in an event on the waiting pod",
            lambda: any(named in (e["message"] or "") for e in e2e.events("Pod", "waits")),
            timeout=15,
        )
        assert f"tainted {KEY}=disk:NoSchedule by DeviceTaintRule {name}, on all" in _status(e2e)

        e2e.pod("tolerates", {"mig": {"resourceClaimTemplateName": "tolerant"}})
        e2e.wait_phase("tolerates", "Running")
        (result,) = e2e.results(e2e.claim_of("tolerates", "mig"))
        assert result["pool"] == pool and result["tolerations"], result
        assert not e2e.results(e2e.claim_of("waits", "mig"))  # still held off
    finally:
        _delete_rule(e2e, name)

    e2e.wait_phase("waits", "Running")
    (result,) = e2e.results(e2e.claim_of("waits", "mig"))
    assert result["pool"] == pool and "tolerations" not in result, result
    assert f"DeviceTaintRule {name}" not in _status(e2e)
