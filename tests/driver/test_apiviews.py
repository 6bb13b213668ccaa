"""driver.apiviews: what each accessor reads, and that no shape makes one raise."""

from __future__ import annotations

import inspect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from driver.apiviews import (
    ClaimView,
    DeviceClassView,
    NodeView,
    ObjectView,
    PodView,
    SliceView,
    key_of,
)

VIEWS = (ObjectView, PodView, ClaimView, NodeView, SliceView, DeviceClassView)


def _pod() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "a"},
            "finalizers": ["f"],
            "ownerReferences": [{"uid": "owner"}],
        },
        "spec": {
            "nodeName": "n1",
            "priority": 5,
            "schedulingGates": [{"name": "g1"}, {"name": "g2"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}],
            "containers": [{"name": "main"}],
            "initContainers": [{"name": "init"}],
        },
        "status": {
            "phase": "Running",
            "startTime": "2026-01-01T00:00:01Z",
            "conditions": [{"type": "PodScheduled", "status": "False"}],
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu"}],
        },
    }


def test_object_metadata() -> None:
    v = ObjectView(_pod())
    assert (v.name, v.namespace, v.uid, v.key) == ("p", "ns", "u1", "ns/p")
    assert v.resource_version == "7"
    assert v.creation_timestamp == "2026-01-01T00:00:00Z"
    assert v.labels == {"app": "a"}
    assert v.has_finalizer("f") and not v.has_finalizer("g")
    assert v.owned_by("owner") and not v.owned_by("other")
    assert not v.deleting and v.deletion_timestamp is None
    assert v.raw["metadata"]["name"] == "p"


def test_a_view_reads_the_object_not_a_copy() -> None:
    pod = _pod()
    v = PodView(pod)
    pod["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    pod["status"]["phase"] = "Succeeded"
    assert v.deleting and v.terminal
    assert v.raw is pod


def test_key_of_cluster_scoped_and_nameless() -> None:
    assert key_of({"metadata": {"name": "n1"}}) == "n1"
    assert key_of({"metadata": {"namespace": "ns", "name": "c"}}) == "ns/c"
    assert key_of({}) == "None"  # as before: logged, never parsed
    assert ObjectView({"metadata": None}).key == "None"


def test_pod() -> None:
    v = PodView(_pod())
    assert v.node_name == "n1" and v.phase == "Running" and not v.terminal
    assert v.priority == 5
    assert v.scheduling_gates == ["g1", "g2"] and v.has_gate("g2")
    assert [c["name"] for c in v.containers] == ["main"]
    assert [c["name"] for c in v.init_containers] == ["init"]
    assert v.resource_claim_statuses[0]["resourceClaimName"] == "p-gpu"
    assert v.condition("PodScheduled") == {"type": "PodScheduled", "status": "False"}
    assert v.condition("Ready") is None
    assert v.start_time == "2026-01-01T00:00:01Z"


def test_an_empty_pod_reads_as_absent() -> None:
    v = PodView({})
    assert (v.node_name, v.phase, v.priority, v.name) == ("", "", 0, "")
    assert v.scheduling_gates == [] and v.resource_claims == [] and not v.terminal


def _claim() -> dict[str, Any]:
    return {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "a", "exactly": {"deviceClassName": "mig.carve"}},
                    {"name": "b", "firstAvailable": [{"deviceClassName": "x"}, "junk"]},
                ],
                "config": [{"opaque": {"driver": "d"}}],
            }
        },
        "status": {
            "allocation": {
                "devices": {"results": [{"driver": "d", "pool": "n1", "device": "g0"}]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["n1"]}
                            ]
                        }
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": "p"}],
        },
    }


def test_claim() -> None:
    v = ClaimView(_claim())
    assert v.class_names == ["mig.carve", "x"]
    assert v.allocated and v.node == "n1"
    assert v.holds_driver("d") and not v.holds_driver("other")
    assert v.reserved_for == [{"resource": "pods", "name": "p"}]
    assert len(v.config) == 1
    assert ClaimView({}).node is None and not ClaimView({}).allocated


def test_a_claim_on_several_nodes_is_on_none() -> None:
    claim = _claim()
    terms = claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"]
    terms.append(terms[0])
    assert ClaimView(claim).node is None


def test_a_claim_pinned_by_the_hostname_label() -> None:
    claim = _claim()
    claim["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2"]}
                ]
            }
        ]
    }
    assert ClaimView(claim).node == "n2"


def test_node_and_slice_and_class() -> None:
    node = NodeView(
        {
            "metadata": {"name": "n1"},
            "spec": {"taints": [{"key": "k"}], "unschedulable": True},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    assert node.key == "n1" and node.unschedulable and node.taints == [{"key": "k"}]
    assert node.condition("Ready") == {"type": "Ready", "status": "True"}
    s = SliceView(
        {"spec": {"driver": "d", "nodeName": "n1", "pool": {"name": "n1", "generation": 3}}}
    )
    assert (s.driver, s.node_name, s.pool_name, s.pool_generation) == ("d", "n1", "n1", 3)
    assert s.devices == ()
    c = DeviceClassView({"spec": {"extendedResourceName": "nvidia.com/mig-1g", "config": [{}]}})
    assert c.extended_resource_name == "nvidia.com/mig-1g" and c.config == [{}]


# -- no shape makes an accessor raise ------------------------------------------------------------

# Every key a view reads, so that generated objects reach every level the accessors walk.
_KEYS = (
    "metadata",
    "spec",
    "status",
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "labels",
    "annotations",
    "finalizers",
    "ownerReferences",
    "nodeName",
    "priority",
    "schedulingGates",
    "resourceClaims",
    "containers",
    "initContainers",
    "affinity",
    "phase",
    "startTime",
    "conditions",
    "resourceClaimStatuses",
    "containerStatuses",
    "type",
    "devices",
    "requests",
    "config",
    "exactly",
    "deviceClassName",
    "firstAvailable",
    "allocation",
    "results",
    "driver",
    "nodeSelector",
    "nodeSelectorTerms",
    "matchFields",
    "matchExpressions",
    "key",
    "operator",
    "values",
    "reservedFor",
    "taints",
    "unschedulable",
    "allocatable",
    "pool",
    "extendedResourceName",
)

_leaf = st.one_of(
    st.none(),
    st.just(""),
    st.just({}),
    st.just([]),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.sampled_from(["In", "metadata.name", "kubernetes.io/hostname", "Succeeded", "x"]),
)
_json = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6),
    ),
    max_leaves=40,
)
_objects = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6)


def _read_everything(view: ObjectView) -> None:
    for name, member in inspect.getmembers(type(view)):
        if name.startswith("_") or name == "raw":
            continue
        if isinstance(member, property):
            getattr(view, name)
        elif callable(member):
            params = list(inspect.signature(member).parameters)[1:]
            getattr(view, name)(*(["x"] * len(params)))


@settings(max_examples=400, deadline=None)
@given(_objects)
def test_no_shape_makes_an_accessor_raise(obj: dict[str, Any]) -> None:
    key_of(obj)
    for view in VIEWS:
        _read_everything(view(obj))
