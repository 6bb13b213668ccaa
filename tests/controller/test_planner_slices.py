"""The planner fed ResourceSlices as the controller caches them (`controller.cache`: shared
parts, packed devices): a node rebuilt from its cached slices after one of them changes, a
pool republished at a new generation, or a slice deleted, gives exactly the model built from
scratch from the plugin's plain JSON, and the usage gauges read the cached slices as the
plain ones."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from controller.cache import PackedDevice, slice_view
from controller.metrics import SliceUsageIndex, slice_usage
from controller.model import GpuInventory, inventories_from_slices
from controller.objects import Kind, key_of
from controller.planner import EnginePlanner
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices

DRIVER = "mig.carve.dev"
NODE = "n1"
MODELS = ("H100-SXM5-80GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "A30-24GB")


def _gpu(minor: int, **changes: Any) -> PublishedGpu:
    fields: dict[str, Any] = {
        "minor": minor,
        "uuid": f"GPU-{NODE}-{minor}",
        "model": gpu_model(MODELS[minor]),
        "pci_bus_id": f"0000:{minor + 7:02x}:00.0",
        "driver_version": "580.105.08",
    }
    fields.update(changes)
    return PublishedGpu(**fields)


def _pool(gpus: list[PublishedGpu], generation: int = 1, **build: Any) -> list[Obj]:
    """The pool as the apiserver would send it: fresh JSON, with uid and resourceVersion."""
    made = build_resource_slices(
        driver=DRIVER, node_name=NODE, pool_generation=generation, gpus=gpus, **build
    )
    for s in made:
        s["metadata"].update(uid=f"{s['metadata']['name']}-{generation}", resourceVersion="1")
    fresh: list[Obj] = json.loads(json.dumps(made))
    return fresh


def _from_scratch(slices: list[Obj]) -> EnginePlanner:
    planner = EnginePlanner(DRIVER)
    keep = slice_view()
    for s in json.loads(json.dumps(slices)):
        planner.observe(Kind.SLICE, keep(s))
    planner.flush()
    return planner


def _inventories(planner: EnginePlanner) -> list[GpuInventory]:
    return [g.inventory for g in planner.model.gpus_on(NODE)]


def _assert_same(planner: EnginePlanner, slices: list[Obj]) -> None:
    """Same model as a planner that saw only ``slices``, and the same GPUs, devices, facts,
    taints and binding conditions as the plain JSON parses to."""
    scratch = _from_scratch(slices)
    assert planner.model.snapshot() == scratch.model.snapshot()
    assert _inventories(planner) == _inventories(scratch)
    plain = sorted(
        inventories_from_slices(json.loads(json.dumps(slices)), DRIVER, on_error=lambda _: None),
        key=lambda g: g.uuid,
    )
    assert _inventories(planner) == plain


class _Fed:
    """A planner fed through the slice informer's transform, as in the controller."""

    def __init__(self, slices: list[Obj]) -> None:
        self.planner = EnginePlanner(DRIVER)
        self.keep = slice_view()
        self.current: dict[str, Obj] = {}
        for s in slices:
            self.update(s)
        self.planner.flush()

    def update(self, s: Obj) -> None:
        self.current[key_of(s)] = s
        self.planner.observe(Kind.SLICE, self.keep(json.loads(json.dumps(s))))

    def delete(self, name: str) -> None:
        self.planner.forget(Kind.SLICE, self.current.pop(name))


def test_cached_slices_hold_packed_devices_equal_to_the_published_ones() -> None:
    published = _pool([_gpu(i) for i in range(4)])
    keep = slice_view()
    cached = [keep(s) for s in json.loads(json.dumps(published))]
    assert cached == published
    devices = [d for s in cached for d in s["spec"].get("devices") or ()]
    assert devices and all(isinstance(d, PackedDevice) for d in devices)


def test_a_node_rebuilt_after_one_of_its_slices_changes_equals_the_model_from_scratch() -> None:
    gpus = [_gpu(i) for i in range(4)]
    fed = _Fed(_pool(gpus))
    _assert_same(fed.planner, list(fed.current.values()))

    # GPU 2 turns sick (a taint on every device) and stops offering itself whole: the plugin
    # rewrites that GPU's devices slice only.
    sick = ({"key": "carve.dev/gpu-health", "value": "xid-79", "effect": "NoSchedule"},)
    gpus[2] = _gpu(2, offers_whole=False, taints=sick)
    changed = next(s for s in _pool(gpus) if s["metadata"]["name"].endswith("gpu-2-devices"))
    fed.update(changed)
    fed.planner.flush()
    assert {d.taints for g in fed.planner.model.gpus_on(NODE)[2:3] for d in g.inventory.devices}
    _assert_same(fed.planner, list(fed.current.values()))


def test_binding_conditions_survive_the_cache() -> None:
    fed = _Fed(_pool([_gpu(0)], binding_conditions=("Carved", "CarveFailed")))
    devices = fed.planner.model.gpus_on(NODE)[0].inventory.devices
    assert {d.binding_conditions for d in devices} == {("Carved",)}
    _assert_same(fed.planner, list(fed.current.values()))


def test_only_the_highest_generation_of_a_pool_counts() -> None:
    fed = _Fed(_pool([_gpu(i) for i in range(4)], generation=1))
    # Generation 2 drops GPU 3; its generation-1 slices linger until the plugin deletes them.
    second = _pool([_gpu(i) for i in range(3)], generation=2)
    for s in second:
        fed.update(s)
    fed.planner.flush()
    assert len(fed.planner.model.gpus_on(NODE)) == 3
    _assert_same(fed.planner, second)
    for name in [k for k in fed.current if "gpu-3" in k]:
        fed.delete(name)
    fed.planner.flush()
    _assert_same(fed.planner, second)


def test_a_deleted_slice_leaves_the_pool_incomplete_as_from_scratch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fed = _Fed(_pool([_gpu(i) for i in range(2)]))
    fed.delete(next(k for k in fed.current if k.endswith("gpu-1-devices")))
    with caplog.at_level(logging.WARNING):
        fed.planner.flush()
    assert fed.planner.model.gpus_on(NODE) == []
    assert "incomplete: 3 of 4 slices present" in caplog.text
    _assert_same(fed.planner, list(fed.current.values()))
    for name in list(fed.current):
        fed.delete(name)
    fed.planner.flush()
    assert not list(fed.planner.model.gpu_nodes())


def test_a_malformed_slice_is_reported_as_from_plain_json(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slices = _pool([_gpu(i) for i in range(2)])
    bad = next(s for s in slices if s["metadata"]["name"].endswith("gpu-1-devices"))
    bad["spec"]["devices"][0]["attributes"]["profileId"] = {"string": "nine"}
    with caplog.at_level(logging.WARNING):
        fed = _Fed(slices)
    cached_report = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _from_scratch(slices)
    assert cached_report and "lacks the int attribute 'profileId'" in cached_report[0]
    assert len(fed.planner.model.gpus_on(NODE)) == 1  # only the bad GPU is left out
    errors: list[str] = []
    inventories_from_slices(slices, DRIVER, on_error=lambda e: errors.append(str(e)))
    assert errors and all(e in cached_report[0] for e in errors)
    _assert_same(fed.planner, slices)


def test_usage_gauges_read_cached_slices_as_plain_ones() -> None:
    published = _pool([_gpu(i) for i in range(4)])
    keep = slice_view()
    cached = {key_of(s): keep(s) for s in json.loads(json.dumps(published))}
    mig = next(
        d["name"]
        for s in published
        for d in s["spec"].get("devices") or ()
        if d["name"].startswith("gpu-1-mig-")
    )
    claims = [
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "r", "driver": DRIVER, "pool": NODE, "device": mig},
                            {"request": "w", "driver": DRIVER, "pool": NODE, "device": "gpu-3"},
                        ]
                    }
                }
            }
        }
    ]
    index = SliceUsageIndex(DRIVER)
    expected = slice_usage(published, claims, DRIVER)
    assert expected.used > 0
    assert index.usage(cached, claims) == expected
    assert index.usage(cached, claims) == expected  # from the index's parts, read once
