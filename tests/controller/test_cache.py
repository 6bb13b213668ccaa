"""What the controller keeps of pods and slices (controller/cache.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller.cache import (
    PackedDevice,
    PackedDevices,
    SharedParts,
    plain_json,
    plain_pod,
    pod_view,
    slice_view,
    strip_bookkeeping,
)
from controller.nodefit import pod_requests
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.contract import DEFAULT_CONTRACT
from driver.resourceslice import PublishedGpu, build_resource_slices

GATE = DEFAULT_CONTRACT.scheduling_gate


def _pod(**spec: Any) -> Obj:
    return {
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "web"},
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "img",
                    "env": [{"name": "A", "value": "b"}],
                    "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}},
                }
            ],
            **spec,
        },
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled"}]},
    }


view = pod_view(GATE, DEFAULT_CONTRACT.driver)


def test_unbound_pods_without_claims_or_gate_are_not_kept() -> None:
    assert view(_pod()) is None


def test_ended_pods_without_claims_are_not_kept() -> None:
    pod = _pod(nodeName="n1")
    pod["status"]["phase"] = "Succeeded"
    assert view(pod) is None


def _job_pod() -> Obj:
    """A training job's gated pod, as tests/support/flood.py writes them, with an MPS client
    limit, an extended resource and everything the controller does not read."""
    from tests.support.flood import job_pod

    pod = job_pod("train-000001", "batch", 1)
    pod["kind"] = "Pod"
    pod["metadata"].update(
        namespace="ns", uid="u1", resourceVersion="7", creationTimestamp="2026-01-01T00:00:00Z"
    )
    pod["metadata"]["annotations"][f"{DEFAULT_CONTRACT.driver}/node"] = "n1"
    pod["metadata"]["ownerReferences"] = [{"kind": "Job", "name": "train", "uid": "j1"}]
    pod["metadata"]["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]
    c = pod["spec"]["containers"][0]
    c["env"].append({"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "50"})
    c["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
    pod["spec"]["initContainers"] = [
        {"name": "sidecar", "image": "s", "restartPolicy": "Always",
         "resources": {"requests": {"cpu": "1"}}, "env": [{"name": "X", "value": "y"}]},
    ]  # fmt: skip
    pod["spec"]["affinity"] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    pod["spec"]["priority"] = 100
    pod["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
        "resourceClaimStatuses": [{"name": "mig", "resourceClaimName": "train-000001-mig-x"}],
        "qosClass": "Burstable",
    }
    return pod


def test_a_carve_pod_is_kept_as_far_as_the_controller_reads_it() -> None:
    """Issue 41.5: every reader of a waiting pod gives the same answer from the projection as
    from the whole pod, which is several times larger."""
    from controller.mpscheck import pod_clients
    from controller.objects import priority_key
    from controller.work import may_need_work
    from driver.apiviews import PodView

    pod = _job_pod()
    kept = view(copy.deepcopy(pod))
    assert kept is not None
    whole, slim = PodView(pod), PodView(kept)
    for read in (
        lambda v: v.scheduling_gates, lambda v: v.resource_claims, lambda v: v.affinity,
        lambda v: v.resource_claim_statuses, lambda v: v.conditions, lambda v: v.priority,
        lambda v: v.phase, lambda v: v.labels, lambda v: v.owner_references, lambda v: v.uid,
        lambda v: v.creation_timestamp, lambda v: v.spec.get("nodeSelector"),
        lambda v: v.spec.get("tolerations"), lambda v: v.resource_version,
    ):  # fmt: skip
        assert read(slim) == read(whole)
    assert pod_requests(kept["spec"]) == pod_requests(pod["spec"])
    names = {"mig": "train-000001-mig-x"}
    assert pod_clients(kept, names) == pod_clients(pod, names) != []
    assert priority_key(kept) == priority_key(pod)
    assert may_need_work(kept, GATE) and may_need_work(pod, GATE)
    assert kept["spec"]["containers"][0]["resources"] == pod["spec"]["containers"][0]["resources"]
    assert kept["metadata"]["annotations"] == {f"{DEFAULT_CONTRACT.driver}/node": "n1"}
    assert "managedFields" not in kept["metadata"] and "volumes" not in kept["spec"]
    assert "image" not in kept["spec"]["containers"][0] and "qosClass" not in kept["status"]
    assert 2 * len(json.dumps(kept)) < len(json.dumps(pod))


def test_a_pod_that_names_a_claim_is_kept_even_without_the_gate() -> None:
    claimed = _pod(resourceClaims=[{"name": "c", "resourceClaimTemplateName": "t"}])
    kept = view(claimed)
    assert kept is not None and kept["spec"]["resourceClaims"] == claimed["spec"]["resourceClaims"]


def test_bound_plain_pods_keep_what_node_fit_reads() -> None:
    pod = _pod(
        nodeName="n1",
        priority=100,
        overhead={"cpu": "50m"},
        initContainers=[
            {
                "name": "side",
                "restartPolicy": "Always",
                "image": "x",
                "resources": {"requests": {"cpu": "1"}},
            },
            {"name": "init", "image": "y", "resources": {"requests": {"memory": "4Gi"}}},
        ],
    )
    kept = view(pod)
    assert kept is not None
    assert pod_requests(kept["spec"]) == pod_requests(pod["spec"])
    assert kept["spec"]["nodeName"] == "n1"
    assert kept["status"] == {"phase": "Pending"}
    assert "labels" not in kept["metadata"] and "managedFields" not in kept["metadata"]
    assert kept["metadata"]["uid"] == "u1" and kept["metadata"]["resourceVersion"] == "7"
    assert len(json.dumps(kept)) < len(json.dumps(pod))


def test_plain_pod_keeps_a_deletion_mark() -> None:
    pod = _pod(nodeName="n1")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert plain_pod(pod)["metadata"]["deletionTimestamp"] == "2026-01-01T00:01:00Z"


def test_strip_bookkeeping_drops_last_applied() -> None:
    obj = {
        "metadata": {
            "name": "x",
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
        }
    }
    assert strip_bookkeeping(obj) == {"metadata": {"name": "x"}}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text("ab", max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text("xyz", max_size=2), inner, max_size=4)
    ),
    max_leaves=20,
)


def _slice(attributes: dict[str, Any], capacity: Any, counters: Any) -> Obj:
    return {
        "metadata": {"name": "s", "managedFields": [{"manager": "x"}]},
        "spec": {
            "devices": [{"name": "d", "attributes": attributes, "capacity": capacity}],
            "sharedCounters": [{"name": "cs", "counters": counters}],
        },
    }


@given(
    st.dictionaries(st.text("pq", max_size=2), json_values, max_size=4), json_values, json_values
)
def test_sharing_never_changes_a_value(
    attributes: dict[str, Any], capacity: Any, counters: Any
) -> None:
    """Whatever a slice holds (even values the API would refuse), sharing keeps it equal and
    keeps 1, 1.0 and true apart."""
    parts = SharedParts()
    first = parts(
        _slice(copy.deepcopy(attributes), copy.deepcopy(capacity), copy.deepcopy(counters))
    )
    again = parts(
        _slice(copy.deepcopy(attributes), copy.deepcopy(capacity), copy.deepcopy(counters))
    )
    expected = _slice(attributes, capacity, counters)
    del expected["metadata"]["managedFields"]
    for got in (first, again):
        assert json.dumps(plain_json(got), sort_keys=True) == json.dumps(expected, sort_keys=True)
        assert isinstance(got["spec"]["devices"][0], PackedDevice)


def test_true_and_one_are_not_shared_with_each_other() -> None:
    parts = SharedParts()
    one = parts(_slice({"a": {"int": 1}}, {"m": {"value": 1}}, {}))
    true = parts(_slice({"a": {"int": True}}, {"m": {"value": True}}, {}))
    assert one["spec"]["devices"][0]["attributes"]["a"]["int"] is not True
    assert true["spec"]["devices"][0]["attributes"]["a"]["int"] is True
    assert true["spec"]["devices"][0]["capacity"]["m"]["value"] is True


def test_unused_parts_are_swept() -> None:
    parts = SharedParts()
    kept = parts(_slice({"a": {"string": "x"}}, {"m": {"value": "1"}}, {"c": {"value": "2"}}))
    parts(_slice({"b": {"string": "gone"}}, {"m": {"value": "9"}}, {"c": {"value": "8"}}))
    assert parts.sweep() == 4  # the second slice's value, capacity, counters and device layout
    again = parts(_slice({"a": {"string": "x"}}, {"m": {"value": "1"}}, {"c": {"value": "2"}}))
    assert again["spec"]["devices"][0]["capacity"] is kept["spec"]["devices"][0]["capacity"]


def _node_slices(node: str, index: int) -> list[Obj]:
    gpus = [
        PublishedGpu(
            i,
            f"GPU-{index:04d}-{i}",
            gpu_model("H100-SXM5-80GB"),
            f"0000:{i:02x}:00.0",
            "580.105.08",
        )
        for i in range(8)
    ]
    made = build_resource_slices(
        driver="mig.carve.dev", node_name=node, pool_generation=1, gpus=gpus
    )
    return json.loads(json.dumps(made))  # fresh objects, as the apiserver's JSON would be


def test_slices_of_equal_gpus_share_their_parts() -> None:
    keep = slice_view()
    first = [keep(s) for s in _node_slices("n1", 1)]
    second = [keep(s) for s in _node_slices("n2", 2)]
    assert first == _node_slices("n1", 1) and second == _node_slices("n2", 2)
    dev1 = next(s for s in first if s["spec"].get("devices"))["spec"]["devices"][3]
    dev2 = next(s for s in second if s["spec"].get("devices"))["spec"]["devices"][3]
    assert dev1["capacity"] is dev2["capacity"]
    assert dev1["consumesCounters"] is dev2["consumesCounters"]


def test_packed_devices_read_as_the_published_list() -> None:
    published = _node_slices("n1", 1)
    cached = [slice_view()(s) for s in _node_slices("n1", 1)]
    for plain, kept in zip(published, cached, strict=True):
        devices = kept["spec"].get("devices")
        if not devices:
            continue
        want = plain["spec"]["devices"]
        assert isinstance(devices, PackedDevices) and len(devices) == len(want)
        assert devices[-1] == want[-1] and devices[1:3] == want[1:3] and devices == want
        first = devices[0]
        assert isinstance(first, PackedDevice) and set(first) == set(want[0])
        assert first.get("taints") is None and "attributes" in first and "taints" not in first
        assert dict(first["attributes"]) == want[0]["attributes"]
        assert first["attributes"].get("nope", 7) == 7
        assert plain_json(kept) == plain and json.dumps(plain_json(kept))


def test_a_device_the_api_would_refuse_is_kept_as_it_came() -> None:
    odd = _slice({}, {"m": {"value": "1"}}, {})
    odd["spec"]["devices"].append({"name": "e", "attributes": ["not", "a", "map"]})
    kept = SharedParts()(copy.deepcopy(odd))
    del odd["metadata"]["managedFields"]
    assert isinstance(kept["spec"]["devices"], list) and kept == odd
