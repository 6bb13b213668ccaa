"""ResourceSlice builder and parser: layout, limits, placement encoding, round trip."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driver.catalog import CATALOG, Engines, Evidence, GpuModel, Placement, ProfileSpec, gpu_model
from driver.contract import DEFAULT_DRIVER_NAME
from driver.geometry import EMPTY_STATE, PlacementError, geometry_for
from driver.naming import is_dns_label, parse_device_name
from driver.quantity import whole_quantity
from driver.resourceslice import (
    MAX_DEVICES_PER_SLICE,
    PublishedGpu,
    build_resource_slices,
)
from driver.slicereader import SlicedGpu, parse_resource_slices

DRIVER = DEFAULT_DRIVER_NAME
MIB = 1 << 20


def _gpu(key: str, minor: int = 0, driver_version: str = "580.105.08") -> PublishedGpu:
    return PublishedGpu(
        minor=minor,
        uuid=f"GPU-{minor:08x}-0000-4000-8000-{key.encode().hex()[:12]:0>12}",
        model=gpu_model(key),
        pci_bus_id=f"0000:{minor + 7:02x}:00.0",
        driver_version=driver_version,
    )


def _build(gpus: list[PublishedGpu], **kw: Any) -> list[dict[str, Any]]:
    args: dict[str, Any] = {
        "driver": DRIVER,
        "node_name": "node-a",
        "pool_generation": 4,
        "gpus": gpus,
    }
    args.update(kw)
    return build_resource_slices(**args)


def _devices(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for s in slices for d in s["spec"].get("devices", [])]


def _geometry_view(model: GpuModel) -> tuple[Any, ...]:
    """What a published model must preserve (labels and PCI ids are not published)."""
    profiles = sorted(
        (p.index, p.id, p.name, p.memory_mib, p.slices, p.multiprocessors, p.engines,
         p.max_instances, p.placements)
        for p in model.profiles
    )  # fmt: skip
    return (
        model.product_name,
        model.architecture,
        model.memory_mib,
        model.memory_units,
        model.compute_slices,
        model.cuda_compute_capability,
        tuple(profiles),
    )


# ---- layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_round_trip_for_every_model(key: str) -> None:
    gpus = [_gpu(key, 0), _gpu(key, 3)]
    parsed = parse_resource_slices(_build(gpus), DRIVER)
    assert [g.minor for g in parsed] == [0, 3]
    for published, sliced in zip(gpus, parsed, strict=True):
        assert _geometry_view(sliced.model) == _geometry_view(published.model)
        assert sliced.uuid == published.uuid
        assert (sliced.node_name, sliced.pool, sliced.generation) == ("node-a", "node-a", 4)
        assert sliced.whole_gpu_device == f"gpu-{published.minor}"
        assert sliced.counter_set == f"gpu-{published.minor}-counters"
        assert sliced.pci_bus_id == published.pci_bus_id
        assert sliced.driver_version == "580.105.8"
        expected = {(p.id, s) for p in published.model.profiles for s in p.starts}
        assert set(sliced.devices) == expected
        for (pid, start), name in sliced.devices.items():
            parsed_name = parse_device_name(name)
            assert (parsed_name.profile_id, parsed_name.placement_start) == (pid, start)
    # the same model on two GPUs rebuilds to one value, so geometry caches are shared
    assert parsed[0].model == parsed[1].model
    assert geometry_for(parsed[0].model) is geometry_for(parsed[1].model)


@pytest.mark.parametrize("key", ["A100-SXM4-40GB", "H100-SXM5-80GB", "A30-24GB"])
def test_a_gpu_offered_only_whole_or_only_as_mig_devices_round_trips(key: str) -> None:
    """Ampere in MIG mode offers no whole GPU, out of it (or a Hopper held whole) no MIG
    device; the counter set stays, and the controller reads the GPU back either way."""
    mig_only = replace(_gpu(key, 0), offers_whole=False)
    whole_only = replace(_gpu(key, 1), offers_mig=False)
    slices = _build([mig_only, whole_only])
    names = {d["name"] for d in _devices(slices)}
    assert "gpu-0" not in names and "gpu-1" in names
    assert not any(parse_device_name(n).minor == 1 and parse_device_name(n).is_mig for n in names)
    a, b = parse_resource_slices(slices, DRIVER)
    assert (a.uuid, a.whole_gpu_device) == (mig_only.uuid, None)
    assert _geometry_view(a.model) == _geometry_view(mig_only.model)
    assert a.pci_bus_id == mig_only.pci_bus_id and a.driver_version == "580.105.8"
    assert (b.uuid, b.whole_gpu_device, dict(b.devices)) == (whole_only.uuid, "gpu-1", {})
    assert b.model.profiles == ()
    assert b.model.memory_mib == whole_only.model.memory_mib
    assert b.model.memory_units == whole_only.model.memory_units
    geometry = geometry_for(b.model)  # a GPU without profiles admits nothing, and says so
    assert geometry.admits(EMPTY_STATE) == {}


def test_a_gpu_must_offer_something() -> None:
    with pytest.raises(ValueError, match="must offer MIG devices or itself"):
        replace(_gpu("H100-SXM5-80GB"), offers_mig=False, offers_whole=False)


def test_a_whole_gpu_device_whose_memory_disagrees_with_its_counters_is_refused() -> None:
    slices = _build([_gpu("H100-SXM5-80GB")])
    whole = next(d for d in _devices(slices) if d["name"] == "gpu-0")
    whole["capacity"]["memory"]["value"] = "1Gi"
    with pytest.raises(ValueError, match="memory capacity differs from the counter set"):
        parse_resource_slices(slices, DRIVER)


def test_split_layout_puts_counters_in_their_own_slice() -> None:
    slices = _build([_gpu("A100-SXM4-40GB", 0), _gpu("H100-SXM5-80GB", 1)])
    assert len(slices) == 4
    for s in slices:
        assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
        spec = s["spec"]
        assert spec["driver"] == DRIVER and spec["nodeName"] == "node-a"
        assert spec["pool"] == {"name": "node-a", "generation": 4, "resourceSliceCount": 4}
        assert ("devices" in spec) != ("sharedCounters" in spec)
    names = [s["metadata"]["name"] for s in slices]
    assert len(set(names)) == len(names)
    assert names[0] == "node-a-mig.carve.dev-gpu-0-counters"


def test_binding_conditions_go_on_every_device_only_when_asked() -> None:
    gpus = [_gpu("A100-SXM4-40GB", 0), _gpu("H100-SXM5-80GB", 1)]
    assert not any("bindingConditions" in d for d in _devices(_build(gpus)))
    devices = _devices(_build(gpus, binding_conditions=("x.dev/Carved", "x.dev/CarveFailed")))
    assert devices
    for d in devices:
        assert d["bindingConditions"] == ["x.dev/Carved"]
        assert d["bindingFailureConditions"] == ["x.dev/CarveFailed"]


def test_taints_go_on_the_gpu_a_single_device_or_the_whole_gpu_device_alone() -> None:
    mine, all_, whole = (
        {"key": f"x.dev/{k}", "effect": "NoSchedule"} for k in ("mine", "all", "whole")
    )
    base = _gpu("H100-SXM5-80GB", 0)
    tainted = replace(base, taints=(all_,), device_taints={(19, 3): (mine,)}, whole_taints=(whole,))
    by_name = {d["name"]: d.get("taints") for d in _devices(_build([tainted]))}
    assert by_name["gpu-0"] == [all_, whole]
    assert by_name["gpu-0-mig-1g10gb-19-3"] == [all_, mine]
    assert by_name["gpu-0-mig-1g10gb-19-4"] == [all_]


def test_combined_layout_for_kubernetes_1_34() -> None:
    slices = _build([_gpu("A30-24GB", 0), _gpu("A30-24GB", 1)], split_counters=False)
    assert len(slices) == 2
    for s in slices:
        assert s["spec"]["pool"]["resourceSliceCount"] == 2
        assert len(s["spec"]["sharedCounters"]) == 1
        used = {d["consumesCounters"][0]["counterSet"] for d in s["spec"]["devices"]}
        assert used == {s["spec"]["sharedCounters"][0]["name"]}
    assert len(parse_resource_slices(slices, DRIVER)) == 2


def test_counter_sets_hold_totals_and_one_counter_per_memory_unit() -> None:
    model = gpu_model("RTX-PRO-6000-Blackwell")
    slices = _build([_gpu(model.key)])
    (cs,) = slices[0]["spec"]["sharedCounters"]
    counters = {k: whole_quantity(v["value"]) for k, v in cs["counters"].items()}
    assert counters["memory"] == model.memory_mib * MIB
    assert counters["multiprocessors"] == 188
    assert (counters["copy-engines"], counters["decoders"], counters["encoders"]) == (4, 4, 4)
    assert (counters["jpeg-engines"], counters["ofa-engines"]) == (4, 1)
    assert sorted(k for k in counters if k.startswith("memory-slice-")) == sorted(
        f"memory-slice-{i}" for i in range(12)
    )
    assert all(is_dns_label(k) for k in counters) and is_dns_label(cs["name"])


def test_identical_models_get_identical_counter_sets_apart_from_the_name() -> None:
    """Cluster Autoscaler needs identical counter sets for identical GPUs."""
    slices = _build([_gpu("H200-SXM5-141GB", 0), _gpu("H200-SXM5-141GB", 5)])
    sets = [s["spec"]["sharedCounters"][0] for s in slices if "sharedCounters" in s["spec"]]
    assert sets[0]["counters"] == sets[1]["counters"]
    assert sets[0]["name"] != sets[1]["name"]


def _described(gpu: PublishedGpu, **facts: Any) -> PublishedGpu:
    """`gpu` with everything the node agent learns from NVML and sysfs (a pair per root)."""
    known: dict[str, Any] = {
        "brand": "Nvidia",
        "cuda_driver_version": "13.0",
        "addressing_mode": "HMM",
        "pcie_root": f"pci0000:{0x17 + 0x20 * (gpu.minor // 2):02x}",
        "numa_node": gpu.minor // 4,
    }
    return replace(gpu, **{**known, **facts})


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_devices_respect_api_limits(key: str) -> None:
    """Every optional attribute included: the most a device ever carries still fits."""
    slices = _build([_described(_gpu(key, m)) for m in range(8)])
    for s in slices:
        assert len(s["spec"].get("devices", [])) <= MAX_DEVICES_PER_SLICE
        assert len(s["spec"].get("sharedCounters", [])) <= 8
        assert len(s["metadata"]["name"]) <= 253
        for cs in s["spec"].get("sharedCounters", []):
            assert len(cs["counters"]) <= 32
    for d in _devices(slices):
        assert is_dns_label(d["name"])
        assert len(d["attributes"]) + len(d["capacity"]) <= 32
        assert len(d["consumesCounters"]) <= 2
        for attr in d["attributes"].values():
            for kind in ("string", "version"):
                assert len(attr.get(kind, "")) <= 64
        for name in d["attributes"]:
            assert len(name.rsplit("/", 1)[-1]) <= 32


def test_attributes_follow_the_nvidia_names() -> None:
    gpu = _gpu("H100-SXM5-80GB", 2)
    devices = {d["name"]: d for d in _devices(_build([gpu]))}
    mig = devices["gpu-2-mig-1g20gb-15-6"]
    attrs = mig["attributes"]
    assert attrs["type"] == {"string": "mig"}
    assert attrs["profile"] == {"string": "1g.20gb"}
    assert attrs["profileId"] == {"int": 15}
    assert attrs["placementStart"] == {"int": 6} and attrs["placementSize"] == {"int": 2}
    assert attrs["parentUUID"] == {"string": gpu.uuid}
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["architecture"] == {"string": "Hopper"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:09:00.0"}
    assert whole_quantity(mig["capacity"]["memory"]["value"]) == 20096 * MIB
    assert whole_quantity(mig["capacity"]["multiprocessors"]["value"]) == 26
    assert set(mig["capacity"]) == {
        "memory", "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines",
        "ofaEngines",
    }  # fmt: skip
    whole = devices["gpu-2"]
    assert whole["attributes"]["type"] == {"string": "gpu"}
    assert whole["attributes"]["uuid"] == {"string": gpu.uuid}
    assert "parentUUID" not in whole["attributes"]


def test_every_device_carries_brand_and_cuda_driver_version() -> None:
    gpu = _described(_gpu("A100-SXM4-40GB", 1), cuda_driver_version="12.8")
    for d in _devices(_build([gpu])):
        assert d["attributes"]["brand"] == {"string": "Nvidia"}
        assert d["attributes"]["cudaDriverVersion"] == {"version": "12.8.0"}  # semver


def test_every_device_carries_the_addressing_mode() -> None:
    for mode in ("HMM", "ATS", "None"):
        gpu = _described(_gpu("H100-SXM5-80GB"), addressing_mode=mode)
        assert {d["attributes"]["addressingMode"]["string"] for d in _devices(_build([gpu]))} == {
            mode
        }


def test_every_device_carries_its_pcie_root_and_numa_node() -> None:
    gpus = [_described(_gpu("H100-SXM5-80GB", m)) for m in range(6)]
    by_minor: dict[int, set[tuple[str, int]]] = {}
    for d in _devices(_build(gpus)):
        attrs = d["attributes"]
        by_minor.setdefault(parse_device_name(d["name"]).minor, set()).add(
            (
                attrs["resource.kubernetes.io/pcieRoot"]["string"],
                attrs["resource.kubernetes.io/numaNode"]["int"],
            )
        )
    assert by_minor == {m: {(gpus[m].pcie_root, m // 4)} for m in range(6)}
    assert by_minor[0] == by_minor[1] != by_minor[2]


def test_pci_bus_id_is_published_in_the_standard_form() -> None:
    """NVML's eight-digit, upper-case domain would never equal another driver's pciBusID."""
    gpu = replace(_gpu("A100-SXM4-40GB"), pci_bus_id="00000000:3B:00.0")
    ids = {
        d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        for d in _devices(_build([gpu]))
    }
    assert ids == {"0000:3b:00.0"}
    with pytest.raises(ValueError, match="not an extended BDF"):
        _build([replace(gpu, pci_bus_id="PCI:59:0:0")])


def test_facts_the_platform_cannot_tell_are_left_out() -> None:
    """As NVIDIA's driver does: no addressingMode where NVML has none, no pcieRoot or numaNode
    where sysfs says nothing; brand and cudaDriverVersion only from a node agent that read them."""
    unknown = _described(
        _gpu("A100-SXM4-40GB"), addressing_mode=None, pcie_root=None, numa_node=None
    )
    for d in _devices(_build([unknown])):
        assert not {
            "addressingMode", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"
        } & set(d["attributes"])  # fmt: skip
        assert d["attributes"]["brand"] == {"string": "Nvidia"}
    for d in _devices(_build([_gpu("A100-SXM4-40GB")])):
        assert not {"brand", "cudaDriverVersion"} & set(d["attributes"])


def test_a_negative_numa_node_is_refused() -> None:
    with pytest.raises(ValueError, match="NUMA node -1"):
        _build([_described(_gpu("A100-SXM4-40GB"), numa_node=-1)])


# ---- placement encoding -------------------------------------------------------------------


def _consumed(device: Mapping[str, Any]) -> dict[str, int]:
    (entry,) = device["consumesCounters"]
    return {k: whole_quantity(v["value"]) for k, v in entry["counters"].items()}


def _slices_of(device: Mapping[str, Any]) -> set[str]:
    return {k for k in _consumed(device) if k.startswith("memory-slice-")}


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_overlapping_placements_share_a_memory_slice_counter(key: str) -> None:
    devices = _devices(_build([_gpu(key)]))
    attrs = {d["name"]: d["attributes"] for d in devices}
    for a in devices:
        for b in devices:
            if a is b:
                continue
            if "placementStart" in attrs[a["name"]] and "placementStart" in attrs[b["name"]]:
                sa, na = (attrs[a["name"]][k]["int"] for k in ("placementStart", "placementSize"))
                sb, nb = (attrs[b["name"]][k]["int"] for k in ("placementStart", "placementSize"))
                overlap = sa < sb + nb and sb < sa + na
            else:
                overlap = True  # the whole GPU overlaps everything
            assert bool(_slices_of(a) & _slices_of(b)) == overlap, (a["name"], b["name"])


def _counters_admit(totals: Mapping[str, int], chosen: list[Mapping[str, Any]]) -> bool:
    used: dict[str, int] = {}
    for d in chosen:
        for k, v in _consumed(d).items():
            used[k] = used.get(k, 0) + v
    return all(v <= totals[k] for k, v in used.items())


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(CATALOG)), st.data())
def test_counters_admit_exactly_what_the_geometry_admits(key: str, data: st.DataObject) -> None:
    """The scheduler sees only counters: they must allow every valid MIG layout and refuse every
    invalid one, or the native path would strand capacity or double-book a GPU."""
    slices = _build([_gpu(key)])
    totals = {
        k: whole_quantity(v["value"])
        for k, v in slices[0]["spec"]["sharedCounters"][0]["counters"].items()
    }
    mig = [d for d in _devices(slices) if d["attributes"]["type"]["string"] == "mig"]
    geometry = geometry_for(gpu_model(key))
    # grow a valid layout, then add one arbitrary extra device
    chosen: list[Mapping[str, Any]] = []
    state = EMPTY_STATE
    for _ in range(data.draw(st.integers(0, 7))):
        options = [
            d for d in mig
            if geometry.fits(state, d["attributes"]["profileId"]["int"],
                             d["attributes"]["placementStart"]["int"])
        ]  # fmt: skip
        if not options:
            break
        pick = data.draw(st.sampled_from(options))
        state = geometry.place(
            state,
            pick["attributes"]["profileId"]["int"],
            pick["attributes"]["placementStart"]["int"],
        )
        chosen.append(pick)
    assert _counters_admit(totals, chosen)
    extra = data.draw(st.sampled_from(mig))
    pid = extra["attributes"]["profileId"]["int"]
    start = extra["attributes"]["placementStart"]["int"]
    assert _counters_admit(totals, [*chosen, extra]) == geometry.fits(state, pid, start)
    whole = next(d for d in _devices(slices) if d["name"] == "gpu-0")
    assert _counters_admit(totals, [whole])
    assert _counters_admit(totals, [*chosen, whole]) == (not chosen)


# ---- device order -------------------------------------------------------------------------


def _order(key: str) -> list[tuple[int, int] | None]:
    out: list[tuple[int, int] | None] = []
    for d in _devices(_build([_gpu(key)])):
        parsed = parse_device_name(d["name"])
        if parsed.profile_id is None or parsed.placement_start is None:
            out.append(None)
        else:
            out.append((parsed.profile_id, parsed.placement_start))
    return out


def test_whole_gpu_comes_last_and_small_profiles_first() -> None:
    order = _order("A100-SXM4-40GB")
    assert order[-1] is None and None not in order[:-1]
    first_of: dict[int, int] = {}
    for item in order[:-1]:
        assert item is not None
        first_of.setdefault(item[0], item[1])
    # small profiles fill the upper half first, keeping 4g (only at 0) and a 3g possible
    assert first_of == {19: 6, 20: 6, 15: 6, 14: 4, 9: 4, 5: 0, 0: 0}
    ids = [item[0] for item in order[:-1] if item is not None]
    assert ids.index(19) < ids.index(20)  # plain 1g before +me: keep the OFA free
    assert ids.index(20) < ids.index(14) < ids.index(9) < ids.index(0)


def test_first_device_of_each_profile_keeps_the_most_room() -> None:
    """Independent check of the order rule: the first placement listed for a profile leaves a
    state that admits at least as many of the largest profile as any other placement."""
    for key in sorted(CATALOG):
        model = gpu_model(key)
        geometry = geometry_for(model)
        biggest = max(model.profiles, key=lambda p: (p.size, p.slices, p.memory_mib))
        seen: set[int] = set()
        for item in _order(key)[:-1]:
            assert item is not None
            pid, start = item
            if pid in seen:
                continue
            seen.add(pid)
            room = {
                s: geometry.admits(geometry.place(EMPTY_STATE, pid, s))[biggest.id]
                for s in model.profile_by_id(pid).starts
            }
            assert room[start] == max(room.values()), (key, pid, room)


# ---- chunking and limits ------------------------------------------------------------------


def _wide_model() -> GpuModel:
    """12 units and eight 1-unit profiles: 96 MIG devices, more than one slice can hold."""
    base = gpu_model("RTX-PRO-6000-Blackwell")
    profiles = tuple(
        ProfileSpec(
            index=i,
            id=100 + i,
            name=f"1g.8gb+v{i}",
            memory_mib=8000,
            slices=1,
            multiprocessors=15,
            engines=Engines(0, 0, 0, 0, 0),
            max_instances=12,
            placements=tuple(Placement(s, 1) for s in range(12)),
            evidence=Evidence.UNVERIFIED,
            note="synthetic",
        )
        for i in range(8)
    )
    full = replace(base.full_profile, placements=(Placement(0, 12),))
    return replace(base, key="wide", profiles=(*profiles, full))


def test_a_gpu_with_more_than_64_devices_is_chunked() -> None:
    gpu = replace(_gpu("RTX-PRO-6000-Blackwell"), model=_wide_model())
    slices = _build([gpu])
    sizes = [len(s["spec"].get("devices", [])) for s in slices]
    assert sizes == [0, 64, 34]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    (sliced,) = parse_resource_slices(slices, DRIVER)
    assert len(sliced.devices) == 97
    with pytest.raises(ValueError, match="at most 64"):
        _build([gpu], split_counters=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"driver": "Mig_Carve"}, "driver name"),
        ({"node_name": "node a"}, "node name"),
        ({"pool_generation": -1}, "generation"),
        ({"gpus": [_gpu("A30-24GB", 0), _gpu("A30-24GB", 0)]}, "duplicate GPU minor"),
        ({"gpus": [_gpu("A30-24GB", 0, driver_version="r580")]}, "driver version"),
    ],
)
def test_bad_inventory_is_refused_with_a_specific_message(
    change: dict[str, Any], message: str
) -> None:
    kw: dict[str, Any] = {"gpus": [_gpu("A30-24GB")], **change}
    with pytest.raises(ValueError, match=message):
        _build(**kw)


def test_too_long_strings_are_refused() -> None:
    model = replace(gpu_model("A30-24GB"), product_name="NVIDIA " + "X" * 60)
    with pytest.raises(ValueError, match="longer than"):
        _build([replace(_gpu("A30-24GB"), model=model)])


def test_long_node_names_give_valid_slice_names() -> None:
    node = ".".join(["n" * 60] * 4)
    slices = _build([_gpu("A30-24GB")], node_name=node)
    names = [s["metadata"]["name"] for s in slices]
    assert all(len(n) <= 253 for n in names) and len(set(names)) == len(names)


def test_no_gpus_means_no_slices() -> None:
    assert _build([]) == []


# ---- parsing ------------------------------------------------------------------------------


def _foreign() -> list[dict[str, Any]]:
    return [
        {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "node-a"}, "devices": [{}]}},
        {"spec": {"driver": "other.example.com"}},
        {"metadata": {"name": "weird"}},
        {"spec": "not a mapping"},
    ]


def test_foreign_slices_are_skipped() -> None:
    slices = _foreign() + _build([_gpu("A30-24GB")])
    assert len(parse_resource_slices(slices, DRIVER)) == 1
    assert parse_resource_slices(_foreign(), DRIVER) == []


def test_only_the_newest_generation_counts() -> None:
    old = _build([_gpu("A30-24GB", 0), _gpu("A30-24GB", 1)], pool_generation=1)
    new = _build([_gpu("A30-24GB", 1)], pool_generation=2)
    parsed = parse_resource_slices(old + new, DRIVER)
    assert [(g.minor, g.generation) for g in parsed] == [(1, 2)]


def test_an_incomplete_pool_is_an_error() -> None:
    slices = _build([_gpu("A30-24GB", 0), _gpu("A30-24GB", 1)])
    with pytest.raises(ValueError, match="incomplete: 3 of 4"):
        parse_resource_slices(slices[:3], DRIVER)


def _break(slices: list[dict[str, Any]], how: str) -> list[dict[str, Any]]:
    broken = copy.deepcopy(slices)
    devices = broken[1]["spec"]["devices"]
    if how == "attribute":
        del devices[0]["attributes"]["profileId"]
    elif how == "counter-set":
        devices[0]["consumesCounters"][0]["counterSet"] = "gpu-9-counters"
    elif how == "memory-slices":
        devices[0]["consumesCounters"][0]["counters"].pop(
            next(k for k in devices[0]["consumesCounters"][0]["counters"] if "slice" in k)
        )
    elif how == "quantity":
        devices[0]["capacity"]["memory"]["value"] = "lots"
    elif how == "architecture":
        devices[-1]["attributes"]["architecture"]["string"] = "Rubin"
    elif how == "name":
        devices[0]["name"] = "card-0"
    return broken


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("attribute", "lacks the int attribute 'profileId'"),
        ("counter-set", "must consume memory-slice"),
        ("memory-slices", "must consume memory-slice"),
        ("quantity", "invalid quantity"),
        ("architecture", "unknown architecture 'Rubin'"),
        ("name", "not a carve device name"),
    ],
)
def test_malformed_slices_give_clear_errors(how: str, message: str) -> None:
    slices = _break(_build([_gpu("A100-SXM4-40GB")]), how)
    with pytest.raises(ValueError, match=message):
        parse_resource_slices(slices, DRIVER)


def test_on_error_skips_only_the_broken_part() -> None:
    good = _build([_gpu("A30-24GB")], node_name="node-b")
    broken_gpu = _break(_build([_gpu("A100-SXM4-40GB", 0), _gpu("A30-24GB", 1)]), "attribute")
    broken_pool = _break(_build([_gpu("A30-24GB")], node_name="node-c"), "name")
    errors: list[ValueError] = []
    parsed = parse_resource_slices(good + broken_gpu + broken_pool, DRIVER, on_error=errors.append)
    assert sorted((g.node_name, g.minor) for g in parsed) == [("node-a", 1), ("node-b", 0)]
    assert len(errors) == 2
    assert "node-a" in str(errors[0]) and "GPU 0" in str(errors[0])


def test_client_models_in_the_api_json_form_parse_and_to_dict_is_explained() -> None:
    """The kubernetes client's objects: sanitize_for_serialization gives the API's JSON, which
    parses; to_dict() gives snake_case keys, which get a message saying what to pass."""
    import json

    from kubernetes import client

    api = client.ApiClient()
    slices = _build([_gpu("A30-24GB")])
    objs = [api.deserialize(json.dumps(s), "V1ResourceSlice", "application/json") for s in slices]
    parsed = parse_resource_slices([api.sanitize_for_serialization(o) for o in objs], DRIVER)
    assert len(parsed) == 1 and parsed[0].model.memory_units == 4
    with pytest.raises(ValueError, match="sanitize_for_serialization"):
        parse_resource_slices([o.to_dict() for o in objs], DRIVER)


def test_parsed_gpu_feeds_the_geometry() -> None:
    (sliced,) = parse_resource_slices(_build([_gpu("A100-SXM4-40GB")]), DRIVER)
    assert isinstance(sliced, SlicedGpu)
    geometry = geometry_for(sliced.model)
    state = geometry.place(EMPTY_STATE, 9, 0)
    assert geometry.feasible_starts(state, 9) == (4,)
    with pytest.raises(PlacementError):
        geometry.place(state, 5, 0)
