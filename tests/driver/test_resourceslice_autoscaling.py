"""What Cluster Autoscaler needs from the published slices (docs/guide/autoscaling.md).

CA builds a node group's template from one existing node's ResourceSlices under new names, so
two nodes with the same GPU models must publish the same pool apart from names (node, pool,
slice and counter-set names, the minor in device names) and per-GPU identity (UUID, PCI bus ID).
"""

from __future__ import annotations

import json

import pytest

from driver.apiobject import Obj
from driver.catalog import CATALOG, gpu_model
from driver.contract import DEFAULT_DRIVER_NAME, PCI_BUS_ID_ATTRIBUTE, Attr
from driver.naming import parse_device_name
from driver.resourceslice import PublishedGpu, build_resource_slices

_IDENTITY = {Attr.UUID, Attr.PARENT_UUID, PCI_BUS_ID_ATTRIBUTE}


def _node(name: str, models: list[str], minors: list[int], generation: int) -> list[Obj]:
    gpus = [
        PublishedGpu(
            minor=minor,
            uuid=f"GPU-{abs(hash((name, minor))) % 16**8:08x}-0000-4000-8000-000000000000",
            model=gpu_model(key),
            pci_bus_id=f"0000:{minor + 0x17:02x}:00.0",
            driver_version="580.105.08",
        )
        for key, minor in zip(models, minors, strict=True)
    ]
    return build_resource_slices(
        driver=DEFAULT_DRIVER_NAME, node_name=name, pool_generation=generation, gpus=gpus
    )


def _device_view(device: Obj) -> Obj:
    parsed = parse_device_name(device["name"])
    return {
        "kind": (parsed.profile_slug, parsed.profile_id, parsed.placement_start),
        "attributes": {k: v for k, v in device["attributes"].items() if k not in _IDENTITY},
        "capacity": device["capacity"],
        "consumes": [c["counters"] for c in device["consumesCounters"]],
    }


def template_view(slices: list[Obj]) -> list[str]:
    """The node's pool as CA's template sees it once names are set aside: per GPU (counter
    set) its counters and the devices that consume from it, sorted so GPUs match up whatever
    their minors."""
    (pool,) = {(s["spec"]["pool"]["name"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
    sets = {
        cs["name"]: cs["counters"] for s in slices for cs in s["spec"].get("sharedCounters", [])
    }
    users: dict[str, list[Obj]] = {name: [] for name in sets}
    for s in slices:
        for d in s["spec"].get("devices", []):
            (consumption,) = {c["counterSet"] for c in d["consumesCounters"]}
            users[consumption].append(_device_view(d))
    per_gpu = [
        json.dumps({"counters": sets[name], "devices": users[name]}, sort_keys=True)
        for name in sets
    ]
    return sorted([json.dumps({"slices": pool[1]}), *per_gpu])


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_two_nodes_of_one_model_publish_the_same_pool_apart_from_names(key: str) -> None:
    a = _node("gpu-node-a", [key, key], [0, 1], generation=1)
    b = _node("gpu-node-b-with-a-longer-name", [key, key], [3, 6], generation=7)
    assert template_view(a) == template_view(b)
    # Not vacuous: the names and identities that were set aside do differ.
    assert {s["metadata"]["name"] for s in a}.isdisjoint(s["metadata"]["name"] for s in b)
    uuids = {
        d["attributes"][Attr.UUID]["string"]
        for s in a + b
        for d in s["spec"].get("devices", [])
        if Attr.UUID in d["attributes"]
    }
    assert len(uuids) == 4


def test_the_comparison_tells_different_models_apart() -> None:
    a = _node("n-a", ["A100-SXM4-40GB"], [0], generation=1)
    b = _node("n-b", ["A100-SXM4-80GB"], [0], generation=1)
    assert template_view(a) != template_view(b)
    mixed = _node("n-c", ["A100-SXM4-40GB", "A100-SXM4-80GB"], [0, 1], generation=1)
    same_gpus_other_order = _node("n-d", ["A100-SXM4-80GB", "A100-SXM4-40GB"], [0, 1], 1)
    assert template_view(mixed) == template_view(same_gpus_other_order)
