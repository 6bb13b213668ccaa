"""Pods asking through extended resources: the pure rules of `controller.extended_resources`,
and the reconciler with the real placement engine pinning such pods (the in-memory writer of
tests/support/reconciler.py stands in for the apiserver; the real one is in
tests/controller/cluster/test_extended_resources_cluster.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.extended_resources import (
    ExtendedResourceError,
    asks_carve_resources,
    extended_requests,
    extended_stand_in,
    pinned_affinity,
    resource_classes,
)
from controller.objects import CarveClasses, EventType, Kind, has_gate
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.contract import (
    DEFAULT_CONTRACT,
    EXTENDED_RESOURCE_CLAIM_ANNOTATION,
    IMPLICIT_EXTENDED_RESOURCE_PREFIX,
)
from driver.resourceslice import PublishedGpu, build_resource_slices
from tests.support.engine_cluster import Cluster, device_class, node, profile_claim

GATE = DEFAULT_CONTRACT.scheduling_gate
DRIVER = "mig.carve.dev"


def profile_class(profile: str, created: str = "2026-01-01T00:00:00Z", **spec: Any) -> Obj:
    name = DEFAULT_CONTRACT.profile_class(profile)
    expr = (
        f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig" && '
        f'device.attributes["{DRIVER}"].profile == "{profile}"'
    )
    return {
        "metadata": {
            "name": name,
            "uid": name,
            "resourceVersion": "1",
            "creationTimestamp": created,
        },
        "spec": {
            "extendedResourceName": f"nvidia.com/mig-{profile}",
            "selectors": [{"cel": {"expression": expr}}],
            **spec,
        },
    }


def limits_pod(
    name: str,
    limits: dict[str, str],
    *,
    init: dict[str, str] | None = None,
    claims: list[str] = (),  # type: ignore[assignment]
    created: str = "2026-01-01T00:00:00Z",
) -> Obj:
    spec: Obj = {
        "containers": [
            {"name": "main", "resources": {"limits": dict(limits), "requests": dict(limits)}}
        ],
        "schedulingGates": [{"name": GATE}],
    }
    if init is not None:
        spec["initContainers"] = [{"name": "setup", "resources": {"limits": dict(init)}}]
    if claims:
        spec["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "creationTimestamp": created,
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


NAMES = {"nvidia.com/mig-3g.40gb": "mig-3g-40gb.mig.carve.dev"}

# -- pure rules ------------------------------------------------------------------------------


def test_names_resolve_as_the_scheduler_resolves_them() -> None:
    classes = {
        "mig-3g-40gb.mig.carve.dev": profile_class("3g.40gb", "2026-01-01T00:00:00Z"),
        "gpu.carve.dev": device_class("gpu.carve.dev", "gpu"),
        "other.example.com": {
            "metadata": {"name": "other.example.com"},
            "spec": {"extendedResourceName": "nvidia.com/gpu"},
        },
    }
    names = resource_classes(classes, CarveClasses())
    assert names == {
        "nvidia.com/mig-3g.40gb": "mig-3g-40gb.mig.carve.dev",
        IMPLICIT_EXTENDED_RESOURCE_PREFIX
        + "mig-3g-40gb.mig.carve.dev": "mig-3g-40gb.mig.carve.dev",
        IMPLICIT_EXTENDED_RESOURCE_PREFIX + "gpu.carve.dev": "gpu.carve.dev",
    }


def test_of_two_classes_naming_one_resource_the_newest_wins_then_the_smaller_name() -> None:
    old = profile_class("3g.40gb", "2026-01-01T00:00:00Z")
    new = profile_class("3g.40gb", "2026-01-02T00:00:00Z")
    new["metadata"]["name"] = "zz.mig.carve.dev"
    names = resource_classes(
        {"a": old, "zz.mig.carve.dev": new}, CarveClasses(names=frozenset({"a"}))
    )
    assert names["nvidia.com/mig-3g.40gb"] == "zz.mig.carve.dev"
    tie = profile_class("3g.40gb", "2026-01-01T00:00:00Z")
    names = resource_classes({"b.mig.carve.dev": tie, "a.mig.carve.dev": old}, CarveClasses())
    assert names["nvidia.com/mig-3g.40gb"] == "a.mig.carve.dev"


def test_requests_are_named_as_the_scheduler_names_them() -> None:
    p = limits_pod("p", {"cpu": "1", "nvidia.com/mig-3g.40gb": "2"})
    (req,) = extended_requests(p, NAMES)
    # sorted request keys: cpu, nvidia.com/... -> index 1
    assert (req.request, req.container, req.count) == ("container-0-request-1", "main", 2)
    assert asks_carve_resources(p, NAMES)
    assert not asks_carve_resources(limits_pod("q", {"nvidia.com/gpu": "1"}), NAMES)


@pytest.mark.parametrize(
    ("pod", "reason", "words"),
    [
        (
            limits_pod("p", {"nvidia.com/mig-3g.40gb": "1"}, claims=["c"]),
            "MixedClaimsAndExtendedResources",
            ["nvidia.com/mig-3g.40gb", "also uses carve ResourceClaims (c)"],
        ),
        (
            limits_pod("p", {"cpu": "1"}, init={"nvidia.com/mig-3g.40gb": "1"}),
            "InvalidExtendedResourceRequest",
            ["init container setup", "sidecars"],
        ),
        (
            limits_pod("p", {"nvidia.com/mig-3g.40gb": "0"}),
            "InvalidExtendedResourceRequest",
            ["'0' is not a whole number of devices"],
        ),
    ],
    ids=["mixed", "init-container", "zero"],
)
def test_bad_asks_are_refused_with_a_specific_message(
    pod: Obj, reason: str, words: list[str]
) -> None:
    claims = [{"metadata": {"name": "c"}}] if pod["spec"].get("resourceClaims") else []
    with pytest.raises(ExtendedResourceError) as err:
        extended_stand_in(pod, claims, NAMES)
    assert err.value.reason == reason
    for w in words:
        assert w in str(err.value)


@given(
    terms=st.lists(
        st.fixed_dictionaries(
            {"matchExpressions": st.just([{"key": "zone", "operator": "In", "values": ["a"]}])}
        ),
        max_size=3,
    )
)
def test_pinning_only_narrows_every_term_to_the_node(terms: list[Obj]) -> None:
    p = limits_pod("p", {"nvidia.com/mig-3g.40gb": "1"})
    if terms:
        p["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        }
    out = pinned_affinity(p, "n7")["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert len(out["nodeSelectorTerms"]) == max(1, len(terms))
    for i, term in enumerate(out["nodeSelectorTerms"]):
        assert {"key": "metadata.name", "operator": "In", "values": ["n7"]} in term["matchFields"]
        if terms:
            assert term["matchExpressions"] == terms[i]["matchExpressions"]


# -- with the reconciler and the real engine -------------------------------------------------


def _with_profile_classes(c: Cluster, *profiles: str) -> None:
    for prof in profiles:
        c.rec.enqueue(Kind.CLASS, EventType.ADDED, profile_class(prof))


def test_best_fit_pins_the_pod_next_to_the_slice_already_in_use() -> None:
    c = Cluster({"a": ["H100-SXM5-80GB"], "b": ["H100-SXM5-80GB"]})
    _with_profile_classes(c, "3g.40gb")
    first = c.submit(profile_claim("held", "3g.40gb"))
    c.rec.drain()
    c.rec.step()
    held_node = c.allocation("held")["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0][
        "values"
    ][0]
    assert not has_gate(c.writer.objects[first], GATE)
    p = limits_pod("limits", {"nvidia.com/mig-3g.40gb": "1"}, created="2026-01-01T01:00:00Z")
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.drain()
    c.rec.step()
    got = c.writer.objects["limits"]
    assert not has_gate(got, GATE)
    term = got["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]
    assert term["matchFields"][0]["values"] == [held_node]
    placed = [e for e in c.events_of("limits") if e[2] == "Placed"]
    assert placed and held_node in placed[0][3] and "3g40gb" in placed[0][3]


def test_a_class_that_takes_an_extended_resource_name_later_is_seen_by_the_next_pod() -> None:
    """The names are resolved once per DeviceClass change, not per pass: a change is seen."""
    c = Cluster({"a": ["H100-SXM5-80GB"]})
    c.rec.enqueue(Kind.CLASS, EventType.ADDED, profile_class("3g.40gb", extendedResourceName="x/y"))
    c.rec.drain()
    c.rec.step()  # a pass resolves the names while the class maps only x/y
    renamed = profile_class("3g.40gb")
    renamed["metadata"]["resourceVersion"] = "2"
    c.rec.enqueue(Kind.CLASS, EventType.MODIFIED, renamed)
    p = limits_pod("limits", {"nvidia.com/mig-3g.40gb": "1"})
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.drain()
    c.rec.step()
    got = c.writer.objects["limits"]
    assert not has_gate(got, GATE)
    assert got["spec"]["affinity"]["nodeAffinity"], "placed by carve's best fit, pinned"
    assert [e for e in c.events_of("limits") if e[2] == "Placed"]


def test_a_profile_no_node_has_waits_gated_with_the_engines_reason() -> None:
    c = Cluster({"a": ["A100-SXM4-40GB"]})
    _with_profile_classes(c, "7g.141gb")
    p = limits_pod("big", {"nvidia.com/mig-7g.141gb": "1"})
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.drain()
    c.rec.step()
    assert has_gate(c.writer.objects["big"], GATE)
    (event,) = [e for e in c.events_of("big") if e[1] == "Warning"]
    assert event[3].startswith("nvidia.com/mig-7g.141gb of container main: "), event
    assert "mig-7g-141gb.mig.carve.dev" in event[3]
    assert "<extended-resources" not in event[3]
    assert c.writer.conditions["big"][0] is False


def test_a_profile_class_refusal_says_nothing_of_whole_gpus() -> None:
    """An A100 in MIG mode offers no whole GPU; a pod asking a MIG profile never wanted one."""
    c = Cluster({})
    a100 = PublishedGpu(0, "GPU-a-0", gpu_model("A100-SXM4-40GB"), "0000:07:00.0", "580.105.08",
                        offers_whole=False)  # fmt: skip
    for s in build_resource_slices(driver=DRIVER, node_name="a", pool_generation=1, gpus=[a100]):
        s["metadata"].update(uid=s["metadata"]["name"], resourceVersion="1")
        c.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    c.rec.enqueue(Kind.NODE, EventType.ADDED, node("a"))
    _with_profile_classes(c, "7g.141gb")
    c.rec.enqueue(
        Kind.POD, EventType.ADDED, c.writer.put(limits_pod("big", {"nvidia.com/mig-7g.141gb": "1"}))
    )
    c.rec.drain()
    c.rec.step()
    (event,) = [e for e in c.events_of("big") if e[1] == "Warning"]
    assert "mig-7g-141gb.mig.carve.dev" in event[3] and "whole GPU" not in event[3], event


def test_mixing_claims_and_limits_waits_with_its_own_reason() -> None:
    c = Cluster({"a": ["H100-SXM5-80GB"]})
    _with_profile_classes(c, "3g.40gb")
    c.rec.enqueue(Kind.CLAIM, EventType.ADDED, c.writer.put(profile_claim("c", "1g.10gb")))
    p = limits_pod("mixed", {"nvidia.com/mig-3g.40gb": "1"}, claims=["c"])
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.drain()
    c.rec.step()
    assert has_gate(c.writer.objects["mixed"], GATE)
    assert not c.allocation("c")
    reasons = {e[2] for e in c.events_of("mixed")}
    assert reasons == {"MixedClaimsAndExtendedResources"}


def _scheduler_claim(pod: Obj, pool: str, device: str) -> Obj:
    """The claim kube-scheduler writes at PreBind for a pinned pod."""
    return {
        "metadata": {
            "name": f"{pod['metadata']['name']}-extended-resources-x",
            "namespace": "ns",
            "uid": "sched-claim",
            "resourceVersion": "5",
            "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            "ownerReferences": [{"kind": "Pod", "uid": pod["metadata"]["uid"], "controller": True}],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "container-0-request-0",
                        "exactly": {"deviceClassName": "mig-3g-40gb.mig.carve.dev", "count": 1},
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "container-0-request-0",
                            "driver": DRIVER,
                            "pool": pool,
                            "device": device,
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["a"]}
                            ]
                        }
                    ]
                },
            },
            "reservedFor": [
                {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
            ],
        },
    }


def test_a_node_with_a_pinned_pod_takes_no_other_decision_until_the_schedulers_claim_is_seen() -> (
    None
):
    """Otherwise carve could allocate the device the scheduler is about to take."""
    now = [1000.0]
    c = Cluster({"a": ["H100-SXM5-80GB"]}, clock=lambda: now[0])
    _with_profile_classes(c, "3g.40gb")
    p = limits_pod("limits", {"nvidia.com/mig-3g.40gb": "1"})
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.step()
    assert not has_gate(c.writer.objects["limits"], GATE)
    follower = c.submit(profile_claim("next", "3g.40gb"))
    c.rec.step()
    assert not c.allocation("next"), "placed while the scheduler's allocation was in flight"
    assert has_gate(c.writer.objects[follower], GATE)
    # The scheduler's claim arrives, holding the placement its first fit chose.
    taken = next(
        d["name"]
        for s in c.rec.stores[Kind.SLICE].values()
        for d in s["spec"].get("devices") or []
        if "-mig-3g40gb-" in d["name"]
    )
    pool = next(iter(c.rec.stores[Kind.SLICE].values()))["spec"]["pool"]["name"]
    c.rec.enqueue(Kind.CLAIM, EventType.ADDED, c.writer.put(_scheduler_claim(p, pool, taken)))
    now[0] += 0.6  # the held decision's retry delay
    c.rec.step()
    alloc = c.allocation("next")
    assert alloc, c.events_of(follower)
    assert alloc["devices"]["results"][0]["device"] != taken


def test_a_pod_another_gate_still_holds_is_pinned_only_once_that_gate_is_gone() -> None:
    c = Cluster({"a": ["H100-SXM5-80GB"]})
    _with_profile_classes(c, "3g.40gb")
    p = limits_pod("queued", {"nvidia.com/mig-3g.40gb": "1"})
    p["spec"]["schedulingGates"].insert(0, {"name": "kueue.x-k8s.io/admission"})
    c.rec.enqueue(Kind.POD, EventType.ADDED, c.writer.put(p))
    c.rec.step()
    held = c.writer.objects["queued"]
    assert has_gate(held, GATE) and "affinity" not in held["spec"]
    assert [e[2] for e in c.events_of("queued")] == ["SchedulingGatedElsewhere"]
    assert "kueue.x-k8s.io/admission" in c.events_of("queued")[0][3]
    held["spec"]["schedulingGates"] = [{"name": GATE}]
    c.rec.enqueue(Kind.POD, EventType.MODIFIED, c.writer.put(held))
    c.rec.step()
    assert not has_gate(c.writer.objects["queued"], GATE)
    assert "affinity" in c.writer.objects["queued"]["spec"]
