"""GPU-level facts held once per GPU must not change what any selector sees.

The placement model keeps the attributes a GPU's devices publish alike (product, driver, PCI
address, parent UUID) once per GPU and only the rest per device. These tests compare every
device's CEL view with the one built from its published attributes alone, without sharing.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.model import inventories_from_slices
from driver.catalog.data import CATALOG
from driver.cel import (
    AttributeValue,
    CelDevice,
    SelectorEvaluator,
    Semver,
    _activation,
    _project,
    common_facts,
)
from driver.resourceslice import PublishedGpu, build_resource_slices

DRIVER = "mig.carve.dev"


def _view(device: CelDevice) -> tuple[object, ...]:
    """Everything a selector can read of a device, with the types a selector tells apart."""
    activation = _canonical(_activation(_project(device, None)))
    typed = tuple((k, type(v), str(v)) for k, v in device.attributes)
    return (activation, typed, device.capacity)


def _canonical(value: object) -> object:
    """Maps sorted by key (CEL maps have no order; a frozenset's iteration order may differ),
    scalars with their type (``1`` and ``True`` are different to a selector)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def _assert_same_view(shared: CelDevice, plain: CelDevice) -> None:
    assert _view(shared) == _view(plain)
    assert shared == plain
    assert hash(shared) == hash(plain)
    for name, _ in plain.attributes:
        assert shared.attribute(name) == plain.attribute(name)


def _slices(model_key: str, *, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    gpus = [
        PublishedGpu(
            minor=i,
            uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
            model=CATALOG[model_key],
            pci_bus_id=f"0000:{0x10 + i:02x}:00.0",
            driver_version="580.105.08",
        )
        for i in range(2)
    ]
    slices = build_resource_slices(driver=DRIVER, node_name="n1", pool_generation=1, gpus=gpus)
    for s in slices:
        for device in s["spec"].get("devices") or ():
            for name, value in (extra or {}).get(device["name"], {}).items():
                device.setdefault("attributes", {})[name] = value
    return slices


def _published_views(slices: list[dict[str, Any]]) -> dict[str, CelDevice]:
    """Each device's facts straight from its published attributes, no sharing."""
    from controller.model import device_facts

    return {
        d["name"]: device_facts(d, DRIVER) for s in slices for d in s["spec"].get("devices") or ()
    }


@pytest.mark.parametrize("model_key", sorted(CATALOG))
def test_every_catalogue_model_keeps_each_devices_view(model_key: str) -> None:
    slices = _slices(model_key)
    plain = _published_views(slices)
    inventories = inventories_from_slices(slices, DRIVER)
    seen = 0
    for inv in inventories:
        for d in inv.devices:
            _assert_same_view(d.facts, plain[d.name])
            seen += 1
        migs = [d for d in inv.devices if d.profile_id >= 0]
        if len(migs) > 1:  # the point of it: a GPU's placements hold their GPU facts once
            assert all(d.facts.shared is migs[0].facts.shared for d in migs)
            assert migs[0].facts.attribute(f"{DRIVER}/parentUUID") == inv.uuid
    assert seen == len(plain)


def test_a_device_level_override_or_addition_is_what_selectors_see() -> None:
    model_key = "A100-SXM4-80GB"
    names = [d["name"] for s in _slices(model_key) for d in s["spec"].get("devices") or ()]
    mig = next(n for n in names if "-mig-" in n)
    other = next(n for n in names if "-mig-" in n and n != mig)
    extra = {
        mig: {"productName": {"string": "overridden"}, "example.com/rack": {"string": "r7"}},
        other: {"driverVersion": {"version": "580.105.8+build"}},
    }
    slices = _slices(model_key, extra=extra)
    plain = _published_views(slices)
    devices = {
        d.name: d.facts for inv in inventories_from_slices(slices, DRIVER) for d in inv.devices
    }
    for name, facts in devices.items():
        _assert_same_view(facts, plain[name])
    assert devices[mig].attribute(f"{DRIVER}/productName") == "overridden"
    assert devices[mig].attribute("example.com/rack") == "r7"
    evaluator = SelectorEvaluator()
    expression = f'device.attributes["{DRIVER}"].productName == "overridden"'
    assert [n for n, f in devices.items() if evaluator.matches(expression, f) is True] == [mig]
    build = f'device.attributes["{DRIVER}"].driverVersion.isGreaterThan(semver("580.0.0"))'
    assert all(evaluator.matches(build, f) is True for f in devices.values())


_values = st.one_of(
    st.booleans(),
    st.integers(-2, 2),
    st.sampled_from(["a", "b", "1"]),
    st.sampled_from(["1.0.0", "1.0.0+x", "1.0.0+y", "2.0.0-rc.1"]).map(Semver.parse),
)
_attributes = st.dictionaries(st.sampled_from(["a", "b", "c", "d", "x.example/e"]), _values)


@settings(max_examples=200, deadline=None)
@given(st.lists(_attributes, min_size=1, max_size=5))
def test_sharing_never_changes_a_view(devices: list[dict[str, AttributeValue]]) -> None:
    plain = [CelDevice.of(DRIVER, attrs) for attrs in devices]
    shared = common_facts(plain)
    for device in plain:
        _assert_same_view(device.sharing(shared), device)
    # an arbitrary "shared" part (one device's facts) must not change another's view either
    for device in plain:
        _assert_same_view(device.sharing(plain[0].attributes), device)
