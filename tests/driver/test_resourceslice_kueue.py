"""carve's counters have the shape Kueue's counter-based DRA quota reads (docs/guide/kueue.md).

Kueue v0.19 (KEP-2941, "Partitionable Devices") lists the driver's ResourceSlices, keeps complete
pools of their newest generation, filters devices by the mapping's `deviceSelector`, the
DeviceClass's and the request's selectors, and charges the largest value of the configured
counter among the matched devices' `consumesCounters`, times the request's count; a matched
device without that counter makes the workload inadmissible. Kueue v0.19 cannot be built here
(v0.17.0 is the newest the module proxy serves), so this checks the shape for every GPU model,
and computes the charges of the page's own configuration as that design describes them.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable

import pytest
import yaml

from controller.model import device_facts
from driver.apiobject import Obj
from driver.catalog import CATALOG, gpu_model
from driver.cel import CelError, compile_selector, evaluate
from driver.contract import DEFAULT_DRIVER_NAME
from driver.quantity import whole_quantity
from driver.resourceslice import PublishedGpu, build_resource_slices
from tests.support.guide import read_page
from tests.support.sourcetext import REPO

MIB = 1 << 20
PAGE = REPO / "docs" / "guide" / "kueue.md"
CLASSES = REPO / "deploy" / "manifests" / "10-deviceclasses.yaml"


def _slices(node: str, models: list[str]) -> list[Obj]:
    gpus = [
        PublishedGpu(
            minor=i,
            uuid=f"GPU-{i:08x}-{node[:4].encode().hex():0>4}-4000-8000-000000000000",
            model=gpu_model(key),
            pci_bus_id=f"0000:{i + 7:02x}:00.0",
            driver_version="580.105.08",
        )
        for i, key in enumerate(models)
    ]
    return build_resource_slices(
        driver=DEFAULT_DRIVER_NAME, node_name=node, pool_generation=3, gpus=gpus
    )


def _devices(slices: Iterable[Obj]) -> list[Obj]:
    return [d for s in slices for d in s["spec"].get("devices", [])]


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_every_device_consumes_memory_from_one_complete_pool(key: str) -> None:
    model = gpu_model(key)
    slices = _slices("node-a", [key, key])
    # Pool complete, one generation (Kueue skips incomplete pools); counters in slices of their
    # own, as Kubernetes >= 1.35 requires.
    assert {s["spec"]["pool"]["name"] for s in slices} == {"node-a"}
    assert {s["spec"]["pool"]["generation"] for s in slices} == {3}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
    sets: dict[str, int] = {}
    for s in slices:
        assert not (s["spec"].get("sharedCounters") and s["spec"].get("devices"))
        for cs in s["spec"].get("sharedCounters", []):
            sets[cs["name"]] = whole_quantity(cs["counters"]["memory"]["value"])
    assert set(sets.values()) == {model.memory_mib * MIB}

    per_profile: dict[str, set[int]] = defaultdict(set)
    for d in _devices(slices):
        consumes = d["consumesCounters"]
        assert 1 <= len(consumes) <= 2  # the API's limit per device
        with_memory = [c for c in consumes if "memory" in c["counters"]]
        assert len(with_memory) == 1, d["name"]  # one unambiguous charge per device
        (entry,) = with_memory
        assert entry["counterSet"] in sets
        charge = whole_quantity(entry["counters"]["memory"]["value"])
        attrs = d["attributes"]  # names of carve's own domain are published unqualified
        if attrs["type"]["string"] == "gpu":
            assert charge == sets[entry["counterSet"]], "a whole GPU is charged all its memory"
        else:
            profile = attrs["profile"]["string"]
            spec = next(p for p in model.profiles if p.name == profile)
            assert charge == spec.memory_mib * MIB, d["name"]
            assert 0 < charge <= sets[entry["counterSet"]]
            per_profile[profile].add(charge)
    # Every placement of a profile costs the same: Kueue's charge cannot depend on which
    # placement carve chooses later.
    assert per_profile and all(len(v) == 1 for v in per_profile.values())


# ---- Kueue's charge for the page's configuration --------------------------------------------


def _page_mapping() -> Obj:
    config = yaml.safe_load(read_page(PAGE).files["kueue-counters.yaml"])
    assert config["featureGates"] == {"KueueDRAIntegrationPartitionableDevices": True}
    (mapping,) = config["resources"]["deviceClassMappings"]
    return dict(mapping)


def _class_selectors() -> dict[str, list[str]]:
    return {
        d["metadata"]["name"]: [s["cel"]["expression"] for s in d["spec"]["selectors"]]
        for d in yaml.safe_load_all(CLASSES.read_text())
        if d
    }


def _matches(expression: str, device: Obj) -> bool:
    selector = compile_selector(expression)
    assert not isinstance(selector, CelError), selector
    result = evaluate(selector, device_facts(device, DEFAULT_DRIVER_NAME))
    assert not isinstance(result, CelError), result
    return result


def kueue_charge(
    slices: list[Obj], mapping: Obj, device_class: str, selectors: list[str], count: int = 1
) -> int | None:
    """KEP-2941's counter charge: None where the workload would be inadmissible."""
    assert device_class in mapping["deviceClassNames"]
    (source,) = mapping["sources"]
    counter = source["counter"]
    pools: dict[str, list[Obj]] = defaultdict(list)
    for s in slices:
        if s["spec"]["driver"] == counter["driver"]:
            pools[s["spec"]["pool"]["name"]].append(s)
    newest = {
        name: [s for s in group if s["spec"]["pool"]["generation"] == max(
            x["spec"]["pool"]["generation"] for x in group
        )]
        for name, group in pools.items()
    }  # fmt: skip
    complete = [g for g in newest.values() if len(g) == g[0]["spec"]["pool"]["resourceSliceCount"]]
    wanted = [counter["deviceSelector"]["cel"]["expression"], *_class_selectors()[device_class]]
    matched = [
        d
        for group in complete
        for d in _devices(group)
        if all(_matches(e, d) for e in [*wanted, *selectors])
    ]
    if len(matched) < count:
        return None
    values = [
        whole_quantity(c["counters"][counter["name"]]["value"])
        for d in matched
        for c in d["consumesCounters"]
        if counter["name"] in c["counters"]
    ]
    return max(values) * count if values else None


def _profile(name: str) -> list[str]:
    return [f'device.attributes["{DEFAULT_DRIVER_NAME}"].profile == "{name}"']


def test_the_pages_counter_mapping_charges_what_the_page_says() -> None:
    mapping = _page_mapping()
    assert mapping["sources"][0]["counter"]["name"] == "memory"
    assert mapping["sources"][0]["counter"]["driver"] == DEFAULT_DRIVER_NAME
    # A mixed cluster: the page's selector scopes the quota to the A100 40GB.
    slices = _slices("a100-node", ["A100-SXM4-40GB"] * 2) + _slices("h100-node", ["H100-SXM5-80GB"])
    mig, gpu = "mig.carve.dev", "gpu.carve.dev"
    assert kueue_charge(slices, mapping, mig, _profile("1g.5gb")) == 4864 * MIB
    assert kueue_charge(slices, mapping, mig, _profile("1g.5gb"), count=3) == 3 * 4864 * MIB
    assert kueue_charge(slices, mapping, mig, _profile("3g.20gb")) == 19968 * MIB
    assert kueue_charge(slices, mapping, gpu, []) == 40960 * MIB
    assert kueue_charge(slices, mapping, mig, []) == 40192 * MIB  # the largest MIG profile
    # An H100 profile matches nothing inside the A100 scope: inadmissible, never charged zero.
    assert kueue_charge(slices, mapping, mig, _profile("1g.5gb+me")) == 4864 * MIB
    assert kueue_charge(slices, mapping, mig, _profile("1g.20gb")) is None  # H100 only


def test_an_incomplete_or_stale_pool_is_not_charged() -> None:
    mapping = _page_mapping()
    slices = _slices("a100-node", ["A100-SXM4-40GB"])
    request = ("mig.carve.dev", _profile("1g.5gb"))
    assert kueue_charge(slices, mapping, *request) == 4864 * MIB
    no_counters = [s for s in slices if not s["spec"].get("sharedCounters")]
    assert kueue_charge(no_counters, mapping, *request) is None
    # A newer generation being published (its counter slice not there yet) hides the old one.
    newer = copy.deepcopy(no_counters)
    for s in newer:
        s["spec"]["pool"]["generation"] += 1
    assert kueue_charge(slices + newer, mapping, *request) is None
