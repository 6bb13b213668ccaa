"""DeviceTaintRules (issue 31, point 1): the admin's way to take devices out of service, which
kube-scheduler honours, applied by carve's controller the same way: which devices a rule
selects, its effect against the claim's tolerations, and the waiting pod's message naming the
rule. `SELECTED` is what kube-scheduler v1.37.2's slice tracker decides (its source; the forms
that cannot taint other tests' devices are checked against the real scheduler in
`tests/cluster/test_device_taint_rules.py`; docs/controller.md, "DeviceTaintRules")."""

from __future__ import annotations

from typing import Any

import pytest

from controller.informers import FirstServed, Informer, InformerConfig
from controller.objects import EventType, Kind
from controller.taintrules import TaintRules
from controller.tolerations import DeviceTaint
from driver.apiobject import Obj
from driver.taintrules import TaintRule, parse_taint_rule, rules_on
from tests.support.engine_cluster import Cluster, node, profile_claim, slices
from tests.support.reconciler import claim

DRIVER = "mig.carve.dev"
KEY = "example.com/maintenance"


def rule(name: str, selector: Obj | None, effect: str = "NoSchedule", value: str = "") -> Obj:
    spec: Obj = {"taint": {"key": KEY, "effect": effect, "timeAdded": "2026-01-01T00:00:00Z"}}
    if value:
        spec["taint"]["value"] = value
    if selector is not None:
        spec["deviceSelector"] = selector
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": spec,
    }


# (selector, does it taint mig.carve.dev / pool n1 / device gpu-0?), as kube-scheduler's tracker
# decides in v1.37.2: no selector taints nothing, an empty one everything.
SELECTED = [
    (None, False),
    ({}, True),
    ({"driver": DRIVER}, True),
    ({"driver": "gpu.nvidia.com"}, False),
    ({"pool": "n1"}, True),
    ({"pool": "n2"}, False),
    ({"device": "gpu-0"}, True),
    ({"device": "gpu-0-mig-1g5gb-19-0"}, False),
    ({"driver": DRIVER, "pool": "n1", "device": "gpu-0"}, True),
    ({"driver": DRIVER, "pool": "n2", "device": "gpu-0"}, False),
]


@pytest.mark.parametrize(("selector", "selected"), SELECTED)
def test_a_rule_selects_devices_as_kube_scheduler_does(
    selector: Obj | None, selected: bool
) -> None:
    parsed = parse_taint_rule(rule("r", selector))
    got = parsed is not None and parsed.selects(DRIVER, "n1", "gpu-0")
    assert got is selected
    assert bool(rules_on([parsed] if parsed else [], DRIVER, "n1", "gpu-0")) is selected


def test_a_rule_is_read_whole_or_not_at_all() -> None:
    parsed = parse_taint_rule(rule("maint", {"pool": "n1"}, "NoExecute", "disk"))
    assert parsed == TaintRule("maint", KEY, "disk", "NoExecute", pool="n1")
    assert parsed.taint == f"{KEY}=disk:NoExecute"
    assert parsed.selector == "pool=n1"
    assert parse_taint_rule(rule("all", {})) is not None
    assert parse_taint_rule(rule("all", {})).selector == "every device"  # type: ignore[union-attr]
    broken = rule("broken", {"pool": 7})
    assert parse_taint_rule(broken) is None
    assert parse_taint_rule({"metadata": {"name": "x"}}) is None


def test_the_registry_marks_only_the_nodes_a_change_reaches() -> None:
    slices = {
        "n1": {"s1": {"spec": {"driver": DRIVER, "pool": {"name": "n1"}}}},
        "n2": {"s2": {"spec": {"driver": DRIVER, "pool": {"name": "n2"}}}},
    }
    rules = TaintRules(DRIVER)
    assert rules.observe(rule("none", None), slices) == set()  # selects nothing
    assert rules.observe(rule("n1", {"pool": "n1"}), slices) == {"n1"}
    assert rules.taints("n1", "gpu-0") == (DeviceTaint(KEY, "", "NoSchedule", "n1"),)
    assert rules.taints("n2", "gpu-0") == ()
    status_only = rule("n1", {"pool": "n1"})
    status_only["status"] = {"conditions": [{"type": "EvictionInProgress", "status": "False"}]}
    assert rules.observe(status_only, slices) == set()  # kube-controller-manager's status
    assert rules.observe(rule("n1", {"pool": "n2"}), slices) == {"n1", "n2"}  # moved
    assert rules.observe(rule("other", {"driver": "gpu.nvidia.com"}), slices) == set()
    assert rules.observe(rule("odd", {}, effect="Evict"), slices) == set()  # unknown: no effect
    assert rules.forget(rule("n1", {"pool": "n2"}), slices) == {"n2"}
    assert rules.taints("n2", "gpu-0") == ()


def _pool_of(c: Cluster, claim_name: str) -> str | None:
    alloc = c.allocation(claim_name)
    return None if alloc is None else str(alloc["devices"]["results"][0]["pool"])


def _add_rule(c: Cluster, obj: Obj, type_: EventType = EventType.ADDED) -> None:
    c.rec.enqueue(Kind.TAINT_RULE, type_, obj)


def test_a_no_schedule_rule_keeps_new_pods_off_a_gpu_and_its_removal_lets_them_back() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"], "n2": ["A100-SXM4-40GB"]})
    maint = rule("a100-maintenance", {"driver": DRIVER, "pool": "n1"})
    _add_rule(c, maint)
    c.submit(profile_claim("first", "7g.40gb"))
    second = c.submit(profile_claim("second", "7g.40gb"))
    c.rec.step()
    assert _pool_of(c, "first") == "n2"  # n1 sorts first and is empty: only the rule says no
    assert _pool_of(c, "second") is None
    (told,) = [e for e in c.events_of(second) if e[1] == "Warning"]
    assert f"{KEY}:NoSchedule from DeviceTaintRule a100-maintenance" in told[3], told
    status, _, message = c.writer.conditions[second]
    assert not status and "DeviceTaintRule a100-maintenance" in message

    _add_rule(c, maint, EventType.DELETED)
    c.rec.step()
    assert _pool_of(c, "second") == "n1"


def test_a_request_that_tolerates_the_rule_may_use_the_device() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    _add_rule(c, rule("drain", {}, "NoExecute", "drain"))
    refused = c.submit(profile_claim("plain", "1g.5gb"))
    tolerant = profile_claim("tolerant", "1g.5gb")
    tolerant["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = [
        {"key": KEY, "operator": "Equal", "value": "drain", "effect": "NoExecute"}
    ]
    c.submit(tolerant)
    c.rec.step()
    assert _pool_of(c, "tolerant") == "n1"
    assert c.allocation("tolerant")["devices"]["results"][0]["tolerations"]  # type: ignore[index]
    assert _pool_of(c, "plain") is None
    (told,) = [e for e in c.events_of(refused) if e[1] == "Warning"]
    assert (
        f"every matching device of DeviceClass mig.carve.dev has a taint the request does not "
        f"tolerate ({KEY}=drain:NoExecute from DeviceTaintRule drain); a DeviceTaintRule holds "
        "devices out of service until an admin deletes it"
    ) in told[3]


@pytest.mark.parametrize(
    ("selector", "effect", "placed"),
    [
        ({}, "None", True),  # informational
        (None, "NoSchedule", True),  # selects nothing
        ({"driver": "gpu.nvidia.com"}, "NoSchedule", True),
        ({"pool": "n1"}, "NoExecute", False),
        ({}, "NoSchedule", False),
    ],
)
def test_effects_and_selectors_on_the_controller(
    selector: Obj | None, effect: str, placed: bool
) -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"]})
    _add_rule(c, rule("r", selector, effect))
    c.submit(profile_claim("c", "1g.5gb"))
    c.rec.step()
    assert (_pool_of(c, "c") is not None) is placed


def test_a_rule_on_the_whole_gpu_device_leaves_its_mig_placements_allocatable() -> None:
    """kube-scheduler taints exactly the named device: ``gpu-0`` is the whole-GPU device, and
    the GPU's MIG placements are devices of their own (a pool-wide rule covers them all)."""
    c = Cluster({"n1": ["H100-SXM5-80GB"]})
    _add_rule(c, rule("whole", {"device": "gpu-0"}))
    whole = c.submit(claim("whole", cls="gpu.carve.dev"))
    c.submit(profile_claim("slice", "1g.10gb"))
    c.rec.step()
    assert _pool_of(c, "slice") == "n1"
    assert _pool_of(c, "whole") is None
    assert any("DeviceTaintRule whole" in e[3] for e in c.events_of(whole))


def test_slices_that_arrive_after_the_rule_are_tainted_too() -> None:
    c = Cluster({})
    _add_rule(c, rule("early", {"pool": "late"}))
    c.rec.step()
    c.rec.enqueue(Kind.NODE, EventType.ADDED, node("late"))
    for s in slices("late", ["A100-SXM4-40GB"]):
        c.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    waiting = c.submit(profile_claim("c", "1g.5gb"))
    c.rec.step()
    assert c.allocation("c") is None
    assert any("DeviceTaintRule early" in e[3] for e in c.events_of(waiting))


def test_a_rule_on_a_full_gpus_neighbour_is_named_beside_the_lack_of_room() -> None:
    c = Cluster({"n1": ["A100-SXM4-40GB"], "n2": ["A100-SXM4-40GB"]})
    _add_rule(c, rule("n1-out", {"pool": "n1"}))
    c.submit(profile_claim("big", "7g.40gb"))
    waiting = c.submit(profile_claim("small", "1g.5gb"))
    c.rec.step()
    assert _pool_of(c, "big") == "n2"
    (told,) = [e for e in c.events_of(waiting) if e[1] == "Warning"]
    assert "no NVIDIA A100-SXM4-40GB GPU has a free 1g.5gb placement" in told[3], told
    assert (
        f"1 GPU(s) held back by taints the request does not tolerate: {KEY}:NoSchedule "
        "from DeviceTaintRule n1-out"
    ) in told[3], told


class _GoneError(Exception):
    status = 404


def test_a_server_without_device_taint_rules_counts_as_listed_with_none() -> None:
    """Kubernetes 1.36 serves them only as v1beta2, and only where enabled: the controller
    must not wait for a list that cannot come."""
    seen: list[tuple[Kind, EventType]] = []
    synced: list[Kind] = []
    informer = Informer(
        Kind.TAINT_RULE,
        FirstServed(),
        lambda k, t, o: seen.append((k, t)),
        synced.append,
        InformerConfig(absent_recheck_s=0.01),
        optional=True,
    )
    informer._not_served()
    assert synced == [Kind.TAINT_RULE] and informer.has_synced and not seen


def test_the_first_served_version_is_used_and_given_up_when_it_goes() -> None:
    calls: list[str] = []
    served = {"v1": False, "v1beta2": True}

    class Version:
        def __init__(self, version: str) -> None:
            self.version = version

        def page(self, limit: int, token: str) -> Any:
            calls.append(self.version)
            if not served[self.version]:
                raise _GoneError()
            return self.version

        def watch(self, resource_version: str, timeout_s: int) -> Any:
            raise AssertionError("not watched here")

    rules = FirstServed(Version("v1"), Version("v1beta2"))
    assert rules.page(1, "") == "v1beta2" and calls == ["v1", "v1beta2"]
    assert rules.page(1, "") == "v1beta2" and calls[2:] == ["v1beta2"]  # remembered
    served.update(v1=True, v1beta2=False)  # the cluster was upgraded
    assert rules.page(1, "") == "v1" and calls[3:] == ["v1beta2", "v1"]
    served["v1"] = False
    with pytest.raises(_GoneError):
        rules.page(1, "")
