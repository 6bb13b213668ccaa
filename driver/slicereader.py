"""The controller's reading of ResourceSlices: each GPU a node publishes, with the MIG
geometry rebuilt from its devices and counters.

The inverse of `driver.resourceslice`: what one builds, the other reads back unchanged, so
the controller needs no GPU catalog and learns a new GPU model from the slices alone. A
malformed slice is reported with what is wrong and where; it never stops the rest being read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from driver.catalog import Architecture, Engines, Evidence, GpuModel, Placement, ProfileSpec
from driver.contract import PCI_BUS_ID_ATTRIBUTE, Attr
from driver.naming import gpu_device_name, parse_device_name
from driver.quantity import whole_quantity
from driver.resourceslice import CAPACITY_COUNTERS, MEMORY_SLICE

__all__ = ["SlicedGpu", "parse_resource_slices"]

_MIB = 1 << 20


@dataclass(frozen=True)
class SlicedGpu:
    """One GPU as the controller sees it in a node's ResourceSlices."""

    node_name: str
    pool: str
    generation: int
    minor: int
    uuid: str
    product_name: str
    # Rebuilt from devices and counters; equal for equal GPUs on any node. A GPU that offers no
    # MIG device has a model without profiles.
    model: GpuModel
    devices: Mapping[tuple[int, int], str]  # (profile_id, placement start) -> device name
    whole_gpu_device: str | None  # None while the GPU is not offered whole
    counter_set: str
    pci_bus_id: str | None = None
    driver_version: str | None = None


def parse_resource_slices(
    slices: Iterable[Mapping[str, Any]],
    driver: str,
    *,
    on_error: Callable[[ValueError], None] | None = None,
) -> list[SlicedGpu]:
    """The GPUs that `driver`'s ResourceSlices publish, the inverse of `build_resource_slices`.

    `slices` are in the API's JSON form (camelCase keys), as a watch with raw JSON or
    `ApiClient().sanitize_for_serialization(obj)` gives them.

    Slices of other drivers are skipped. Per pool only the highest generation counts, as in the
    scheduler. A malformed pool or GPU raises ValueError naming the slice and what is wrong;
    with `on_error` the error is reported there instead and only that pool or GPU is skipped,
    so one broken node never hides the rest of the cluster from the controller.
    """
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for obj in slices:
        spec = obj.get("spec") if isinstance(obj, Mapping) else None
        if not isinstance(spec, Mapping) or spec.get("driver") != driver:
            continue
        if "node_name" in spec or "shared_counters" in spec:
            _report(
                on_error,
                ValueError(
                    f"ResourceSlice {_slice_label(obj)} uses snake_case keys (a client model's "
                    "to_dict()); pass the API's JSON form, e.g. "
                    "kubernetes.client.ApiClient().sanitize_for_serialization(obj)"
                ),
            )
            continue
        pool = spec.get("pool")
        name = pool.get("name") if isinstance(pool, Mapping) else None
        if not isinstance(name, str):
            _report(on_error, ValueError(f"ResourceSlice {_slice_label(obj)} has no pool name"))
            continue
        pools.setdefault(name, []).append(obj)

    result: list[SlicedGpu] = []
    for pool_name in sorted(pools):
        try:
            result.extend(_parse_pool(pool_name, pools[pool_name], on_error))
        except ValueError as err:
            _report(on_error, err)
    return result


def _report(on_error: Callable[[ValueError], None] | None, err: ValueError) -> None:
    if on_error is None:
        raise err
    on_error(err)


def _slice_label(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return repr(name) if isinstance(name, str) else "<unnamed>"


def _generation(obj: Mapping[str, Any]) -> int:
    generation = obj["spec"]["pool"].get("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise ValueError(f"ResourceSlice {_slice_label(obj)}: pool generation is not an integer")
    return generation


def _parse_pool(
    pool_name: str,
    objs: list[Mapping[str, Any]],
    on_error: Callable[[ValueError], None] | None,
) -> list[SlicedGpu]:
    generation = max(_generation(o) for o in objs)
    current = [o for o in objs if _generation(o) == generation]
    where = f"pool {pool_name!r} generation {generation}"
    expected = current[0]["spec"]["pool"].get("resourceSliceCount")
    if not isinstance(expected, int) or len(current) < expected:
        raise ValueError(
            f"{where} is incomplete: {len(current)} of {expected} slices present "
            "(the node is probably republishing; retry later)"
        )
    node_names = {o["spec"].get("nodeName") for o in current}
    if len(node_names) != 1 or not isinstance(node_name := node_names.pop(), str):
        raise ValueError(f"{where}: slices must all name the same node in spec.nodeName")

    counter_sets: dict[str, dict[str, int]] = {}
    devices: dict[int, list[tuple[Mapping[str, Any], str]]] = {}
    for obj in current:
        label = _slice_label(obj)
        for cs in obj["spec"].get("sharedCounters") or []:
            name, counters = _counter_set_values(cs, label)
            if name in counter_sets:
                raise ValueError(f"{where}: counter set {name!r} is published twice")
            counter_sets[name] = counters
        for dev in obj["spec"].get("devices") or []:
            if not isinstance(dev, Mapping) or not isinstance(dev.get("name"), str):
                raise ValueError(f"ResourceSlice {label}: a device has no name")
            minor = parse_device_name(dev["name"]).minor
            devices.setdefault(minor, []).append((dev, label))

    gpus = []
    for minor in sorted(devices):
        try:
            gpus.append(
                _parse_gpu(
                    node_name=node_name,
                    pool=pool_name,
                    generation=generation,
                    minor=minor,
                    entries=devices[minor],
                    counter_sets=counter_sets,
                )
            )
        except ValueError as err:
            _report(on_error, ValueError(f"{where}, GPU {minor}: {err}"))
    return gpus


def _counter_set_values(cs: object, label: str) -> tuple[str, dict[str, int]]:
    if not isinstance(cs, Mapping) or not isinstance(cs.get("name"), str):
        raise ValueError(f"ResourceSlice {label}: a counter set has no name")
    counters = cs.get("counters")
    if not isinstance(counters, Mapping):
        raise ValueError(f"ResourceSlice {label}: counter set {cs['name']!r} has no counters")
    return cs["name"], _counter_values(counters, f"ResourceSlice {label}: counter")


def _attr(dev: Mapping[str, Any], name: str, kind: str) -> Any:
    attrs = dev.get("attributes")
    entry = attrs.get(name) if isinstance(attrs, Mapping) else None
    if not isinstance(entry, Mapping) or kind not in entry:
        raise ValueError(f"device {dev['name']!r} lacks the {kind} attribute {name!r}")
    value = entry[kind]
    expected = int if kind == "int" else str
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ValueError(f"device {dev['name']!r}: attribute {name!r} is not a {kind}")
    return value


def _capacities(dev: Mapping[str, Any]) -> tuple[int, ...]:
    cap = dev.get("capacity")
    if not isinstance(cap, Mapping):
        raise ValueError(f"device {dev['name']!r} has no capacity")
    values = []
    for name, _ in CAPACITY_COUNTERS:
        entry = cap.get(name)
        if not isinstance(entry, Mapping) or "value" not in entry:
            raise ValueError(f"device {dev['name']!r} lacks capacity {name!r}")
        values.append(whole_quantity(entry["value"]))
    return tuple(values)


def _consumed(dev: Mapping[str, Any]) -> tuple[str, dict[str, int]]:
    entries = dev.get("consumesCounters")
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], Mapping):
        raise ValueError(f"device {dev['name']!r} must consume exactly one counter set")
    entry = entries[0]
    counters = entry.get("counters")
    if not isinstance(entry.get("counterSet"), str) or not isinstance(counters, Mapping):
        raise ValueError(f"device {dev['name']!r} has a malformed consumesCounters entry")
    return entry["counterSet"], _counter_values(
        counters, f"device {dev['name']!r}: consumed counter"
    )


def _counter_values(counters: Mapping[str, Any], what: str) -> dict[str, int]:
    """Counter name -> amount; `what` starts the error for a counter without a value."""
    values: dict[str, int] = {}
    for key, counter in counters.items():
        if not isinstance(counter, Mapping) or "value" not in counter:
            raise ValueError(f"{what} {key!r} has no value")
        values[str(key)] = whole_quantity(counter["value"])
    return values


@dataclass
class _ProfileRow:
    """What the devices of one profile id say about the profile; they must all agree."""

    name: str
    index: int
    max_instances: int
    amounts: tuple[int, ...]
    size: int
    starts: list[int]


def _find_whole_gpu(
    entries: list[tuple[Mapping[str, Any], str]], minor: int
) -> Mapping[str, Any] | None:
    whole = [dev for dev, _ in entries if not parse_device_name(dev["name"]).is_mig]
    if not whole:
        return None
    if len(whole) != 1:
        raise ValueError(f"expected at most one whole-GPU device {gpu_device_name(minor)!r}")
    if _attr(whole[0], Attr.TYPE, "string") != "gpu":
        raise ValueError(f"device {whole[0]['name']!r} must have type 'gpu'")
    return whole[0]


def _whole_gpu_memory(counter_set: str, counter_sets: Mapping[str, Mapping[str, int]]) -> int:
    """The GPU's memory in bytes, from its counter set (published whether or not the whole GPU
    is offered as a device)."""
    memory = counter_sets.get(counter_set, {}).get("memory")
    if memory is None:
        raise ValueError(f"counter set {counter_set!r} has no 'memory' counter")
    return memory


def _memory_units(counter_set: str, counter_sets: Mapping[str, Mapping[str, int]]) -> int:
    counters = counter_sets.get(counter_set)
    if counters is None:
        raise ValueError(f"counter set {counter_set!r} is not published in the pool")
    units = sorted(int(m[1]) for k in counters if (m := MEMORY_SLICE.fullmatch(k)))
    if not units or units != list(range(len(units))):
        raise ValueError(f"counter set {counter_set!r} must have memory-slice-0..N-1 counters")
    return len(units)


def _architecture(gpu_dev: Mapping[str, Any]) -> Architecture:
    arch_name = _attr(gpu_dev, Attr.ARCHITECTURE, "string")
    try:
        return Architecture(arch_name)
    except ValueError:
        known = ", ".join(a.value for a in Architecture)
        raise ValueError(f"unknown architecture {arch_name!r} (known: {known})") from None


def _compute_capability(gpu_dev: Mapping[str, Any]) -> tuple[int, int]:
    cc = _attr(gpu_dev, Attr.CUDA_COMPUTE_CAPABILITY, "version").split(".")
    if len(cc) < 2 or not (cc[0].isdigit() and cc[1].isdigit()):
        raise ValueError(f"cudaComputeCapability {'.'.join(cc)!r} is not a version")
    return int(cc[0]), int(cc[1])


def _check_placement(
    dev: Mapping[str, Any], uuid: str, counter_set: str, memory_units: int
) -> tuple[int, int, int]:
    """(profile id, start, size) of one MIG device, checked against its name, its GPU and the
    memory slices it consumes: the controller rebuilds the geometry from exactly these."""
    parsed = parse_device_name(dev["name"])
    pid = _attr(dev, Attr.PROFILE_ID, "int")
    start = _attr(dev, Attr.PLACEMENT_START, "int")
    size = _attr(dev, Attr.PLACEMENT_SIZE, "int")
    if (pid, start) != (parsed.profile_id, parsed.placement_start):
        raise ValueError(f"device {dev['name']!r}: name and attributes disagree")
    if _attr(dev, Attr.PARENT_UUID, "string") != uuid:
        raise ValueError(f"device {dev['name']!r}: parentUUID is not {uuid!r}")
    used_set, used = _consumed(dev)
    slices_used = sorted(int(m[1]) for k in used if (m := MEMORY_SLICE.fullmatch(k)))
    if used_set != counter_set or slices_used != list(range(start, start + size)):
        raise ValueError(
            f"device {dev['name']!r} must consume memory-slice-{start}.."
            f"{start + size - 1} of {counter_set!r}"
        )
    if start + size > memory_units:
        raise ValueError(f"device {dev['name']!r} lies beyond {memory_units} memory units")
    return pid, start, size


def _profile_rows(
    mig_devices: Iterable[Mapping[str, Any]], uuid: str, counter_set: str, memory_units: int
) -> tuple[dict[int, _ProfileRow], dict[tuple[int, int], str]]:
    rows: dict[int, _ProfileRow] = {}
    names: dict[tuple[int, int], str] = {}
    for dev in mig_devices:
        pid, start, size = _check_placement(dev, uuid, counter_set, memory_units)
        name = _attr(dev, Attr.PROFILE, "string")
        amounts = _capacities(dev)
        row = rows.setdefault(
            pid,
            _ProfileRow(
                name,
                _attr(dev, Attr.PROFILE_INDEX, "int"),
                _attr(dev, Attr.MAX_INSTANCES, "int"),
                amounts,
                size,
                [],
            ),
        )
        if (row.name, row.size, row.amounts) != (name, size, amounts):
            raise ValueError(f"devices of profile id {pid} disagree on name, size or capacity")
        row.starts.append(start)
        names[(pid, start)] = dev["name"]
    return rows, names


def _profile_spec(pid: int, row: _ProfileRow) -> ProfileSpec:
    slices = row.name.split("g.", 1)[0]
    if not slices.isdigit():
        raise ValueError(f"profile {row.name!r} does not start with '<slices>g.'")
    return ProfileSpec(
        index=row.index,
        id=pid,
        name=row.name,
        memory_mib=row.amounts[0] // _MIB,
        slices=int(slices),
        multiprocessors=row.amounts[1],
        engines=Engines(*row.amounts[2:7]),
        max_instances=row.max_instances,
        placements=tuple(Placement(s, row.size) for s in sorted(row.starts)),
        evidence=Evidence.INFERRED,
        note="reconstructed from ResourceSlices",
    )


def _parse_gpu(
    *,
    node_name: str,
    pool: str,
    generation: int,
    minor: int,
    entries: list[tuple[Mapping[str, Any], str]],
    counter_sets: Mapping[str, Mapping[str, int]],
) -> SlicedGpu:
    whole_dev = _find_whole_gpu(entries, minor)
    mig_devices = [dev for dev, _ in entries if dev is not whole_dev]
    # The GPU's own facts are on every device; the whole-GPU one names the UUID itself, a MIG
    # device names it as parentUUID.
    gpu_dev = whole_dev if whole_dev is not None else mig_devices[0]
    counter_set, _ = _consumed(gpu_dev)
    memory_units = _memory_units(counter_set, counter_sets)
    memory = _whole_gpu_memory(counter_set, counter_sets)
    if whole_dev is not None:
        uuid = _attr(whole_dev, Attr.UUID, "string")
        if _capacities(whole_dev)[0] != memory:
            raise ValueError(
                f"device {whole_dev['name']!r}: memory capacity differs from the counter set's"
            )
    else:
        uuid = _attr(gpu_dev, Attr.PARENT_UUID, "string")
    product = _attr(gpu_dev, Attr.PRODUCT_NAME, "string")
    architecture = _architecture(gpu_dev)
    cc = _compute_capability(gpu_dev)
    rows, names = _profile_rows(mig_devices, uuid, counter_set, memory_units)
    profiles = sorted((_profile_spec(pid, row) for pid, row in rows.items()), key=lambda p: p.index)
    model = _shared_model(
        GpuModel(
            key=product,
            product_name=product,
            pci_device_ids=(),
            architecture=architecture,
            memory_mib=memory // _MIB,
            memory_units=memory_units,
            compute_slices=max((p.slices for p in profiles), default=0),
            cuda_compute_capability=cc,
            profiles=tuple(profiles),
            placement_evidence=Evidence.INFERRED,
            note="reconstructed from ResourceSlices",
        )
    )
    return SlicedGpu(
        node_name=node_name,
        pool=pool,
        generation=generation,
        minor=minor,
        uuid=uuid,
        product_name=product,
        model=model,
        devices=MappingProxyType(names),
        whole_gpu_device=None if whole_dev is None else whole_dev["name"],
        counter_set=counter_set,
        pci_bus_id=_optional_text(gpu_dev, PCI_BUS_ID_ATTRIBUTE, "string"),
        driver_version=_optional_text(gpu_dev, Attr.DRIVER_VERSION, "version"),
    )


@functools.lru_cache(maxsize=256)
def _shared_model(model: GpuModel) -> GpuModel:
    """One object per distinct rebuilt model: every GPU of a model gives an equal one, and the
    controller keeps one per GPU (~4 KB of profiles each, ~30 KB per GPU node)."""
    return model


def _optional_text(dev: Mapping[str, Any], name: str, kind: str) -> str | None:
    """A string or version attribute that older publishers may have left out."""
    entry = (dev.get("attributes") or {}).get(name)
    value = entry.get(kind) if isinstance(entry, Mapping) else None
    return value if isinstance(value, str) else None
