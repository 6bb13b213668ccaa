"""ResourceSlices that publish MIG GPUs as DRA partitionable devices, and their inverse.

The node's kubelet plugin publishes what could be carved, not what is carved: per GPU one device
per (profile, listed placement) plus the whole GPU, all drawing on one counter set. A GPU may
offer only one of the two kinds (`PublishedGpu.offers_mig` / `offers_whole`): an Ampere GPU
offers MIG devices while in MIG mode and the whole GPU only while not (its MIG mode changes
only with a GPU reset), and a Hopper GPU held whole offers no MIG device until it is released.
The counter set holds the GPU's capacities (memory in bytes, multiprocessors, engine pools)
and one counter `memory-slice-<i>` of value 1 per memory unit. A MIG device consumes its
capacities and the memory slices its placement covers, so kube-scheduler (and Cluster
Autoscaler, and Kueue, which charges the `memory` counter) enforce the same overlap and
engine-pool rules as `driver.geometry` without knowing anything about MIG. The controller reads
the slices back with `parse_resource_slices`.

Layouts: Kubernetes >= 1.35 requires counters and devices in different slices of one pool and
generation (`split_counters=True`); 1.34 wants both in one slice. Slices using counters hold at
most 64 devices, so every GPU gets its own slice(s).

Everything here is pure: manifests are plain JSON-ready dicts with the API's camelCase keys.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any

from driver.catalog import (
    Architecture,
    Engines,
    Evidence,
    GpuModel,
    Placement,
    ProfileSpec,
)
from driver.contract import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    Attr,
)
from driver.geometry import EMPTY_STATE, Geometry, geometry_for
from driver.naming import (
    counter_set_name,
    gpu_device_name,
    memory_slice_counter,
    mig_device_name,
    parse_device_name,
)
from driver.pcie import standard_bus_id

__all__ = [
    "API_VERSION",
    "MAX_DEVICES_PER_SLICE",
    "PublishedGpu",
    "SlicedGpu",
    "build_resource_slices",
    "parse_quantity",
    "parse_resource_slices",
]

API_VERSION = "resource.k8s.io/v1"

# API limits (resource/v1 types.go, 1.34-1.37); checked here so a bad inventory fails on the
# node with a specific message instead of as an apiserver rejection.
MAX_DEVICES_PER_SLICE = 64  # with consumesCounters (128 without)
_MAX_ATTRIBUTES_AND_CAPACITIES = 32
_MAX_ATTRIBUTE_STRING = 64
_MAX_COUNTERS_PER_SET = 32
_MAX_DRIVER_NAME = 63
_MAX_OBJECT_NAME = 253
_MAX_TAINTS = 16  # per device (1.35+)
_TAINT_EFFECTS = frozenset({"NoSchedule", "NoExecute", "None"})

_MIB = 1 << 20

# Capacity name (device, camelCase) -> counter name (counter set, DNS label), in publish order.
_CAPACITY_COUNTERS = (
    ("memory", "memory"),
    ("multiprocessors", "multiprocessors"),
    ("copyEngines", "copy-engines"),
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpegEngines", "jpeg-engines"),
    ("ofaEngines", "ofa-engines"),
)

_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*"
)
_MEMORY_SLICE = re.compile(r"memory-slice-(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class PublishedGpu:
    """One physical GPU as the node discovered it (from NVML or the simulator)."""

    minor: int  # device minor of /dev/nvidia<minor>
    uuid: str  # "GPU-..."
    model: GpuModel
    pci_bus_id: str  # NVML's "00000000:3B:00.0" or the standard "0000:3b:00.0"
    driver_version: str  # as NVML prints it, e.g. "580.105.08"
    offers_mig: bool = True  # publish the (profile, placement) devices
    offers_whole: bool = True  # publish the whole-GPU device
    # DRA device taints every device of the GPU carries ({key, value, effect}), e.g. while the
    # GPU is unhealthy (driver.gpuhealth)
    taints: tuple[Mapping[str, str], ...] = ()
    # more taints for single MIG devices, by (profile id, placement start): the device of a
    # MIG instance that had an error of its own
    device_taints: Mapping[tuple[int, int], tuple[Mapping[str, str], ...]] = field(
        default_factory=dict
    )
    # more taints for the whole-GPU device alone: a MIG instance carve did not create blocks it
    whole_taints: tuple[Mapping[str, str], ...] = ()
    # The rest of NVIDIA's DRA driver's attribute set. The node agent always knows the first
    # two (NVML answers on every driver); the others where the platform says (None: the
    # attribute is left out, as NVIDIA's driver leaves it out).
    brand: str | None = None  # "Nvidia" (nvmlDeviceGetBrand)
    cuda_driver_version: str | None = None  # "13.0" (nvmlSystemGetCudaDriverVersion)
    addressing_mode: str | None = None  # "HMM", "ATS" or "None" (nvmlDeviceGetAddressingMode)
    pcie_root: str | None = None  # "pci0000:3a" (sysfs, driver.pcie)
    numa_node: int | None = None  # sysfs numa_node, >= 0

    def __post_init__(self) -> None:
        if not (self.offers_mig or self.offers_whole):
            raise ValueError(f"GPU {self.minor} ({self.uuid}) must offer MIG devices or itself")
        for taints in (self.taints, self.whole_taints, *self.device_taints.values()):
            self._check_taints(taints)

    def _check_taints(self, taints: tuple[Mapping[str, str], ...]) -> None:
        if len(taints) > _MAX_TAINTS:
            raise ValueError(f"GPU {self.minor}: at most {_MAX_TAINTS} taints per device")
        for t in taints:
            if t.get("effect") not in _TAINT_EFFECTS or not t.get("key"):
                raise ValueError(
                    f"GPU {self.minor}: taint {dict(t)} needs a key and an effect of "
                    f"{', '.join(sorted(_TAINT_EFFECTS))}"
                )


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


# ---- building -------------------------------------------------------------------------------


def build_resource_slices(
    *,
    driver: str,
    node_name: str,
    pool_generation: int,
    gpus: Sequence[PublishedGpu],
    split_counters: bool = True,
    binding_conditions: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The complete pool of `node_name` as resource.k8s.io/v1 ResourceSlice manifests.

    `binding_conditions` = (condition, failure condition) puts both on every device: whoever
    allocates one (kube-scheduler or carve's controller) copies them into the allocation, and
    kube-scheduler binds the pod only once the node reports the device carved.

    The pool is named after the node; every slice carries the same generation and the pool's
    total slice count (counter-only slices included). Slice names are deterministic, so a
    publisher can create-or-update them and delete any other slice of the pool. No GPUs give
    no slices (a pool needs at least one), which tells the publisher to delete them all.
    Raises ValueError when the inventory cannot be published within the API's limits.
    """
    _check_dns_subdomain("driver name", driver, _MAX_DRIVER_NAME)
    _check_dns_subdomain("node name", node_name, _MAX_OBJECT_NAME)
    if pool_generation < 0:
        raise ValueError(f"pool generation must be >= 0, got {pool_generation}")
    _check_unique("GPU minor", [g.minor for g in gpus])
    _check_unique("GPU UUID", [g.uuid for g in gpus])

    specs: list[tuple[str, dict[str, Any]]] = []  # (slice name, spec without pool)
    for gpu in sorted(gpus, key=lambda g: g.minor):
        counter_set = _counter_set(gpu)
        devices = _devices(gpu)
        if binding_conditions is not None:
            done, failed = binding_conditions
            for d in devices:
                d["bindingConditions"] = [done]
                d["bindingFailureConditions"] = [failed]
        base = f"gpu-{gpu.minor}"
        if split_counters:
            specs.append((f"{base}-counters", {"sharedCounters": [counter_set]}))
            chunks = [
                devices[i : i + MAX_DEVICES_PER_SLICE]
                for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)
            ]
            for n, chunk in enumerate(chunks):
                suffix = f"{base}-devices" if n == 0 else f"{base}-devices-{n}"
                specs.append((suffix, {"devices": chunk}))
        else:
            if len(devices) > MAX_DEVICES_PER_SLICE:
                raise ValueError(
                    f"GPU {gpu.minor} ({gpu.model.key}) needs {len(devices)} devices; a combined "
                    f"slice (Kubernetes 1.34) holds at most {MAX_DEVICES_PER_SLICE} and cannot "
                    "share its counter set with another slice"
                )
            specs.append((base, {"sharedCounters": [counter_set], "devices": devices}))

    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": _slice_name(node_name, driver, suffix)},
            "spec": {
                "driver": driver,
                "pool": {
                    "name": node_name,
                    "generation": pool_generation,
                    "resourceSliceCount": len(specs),
                },
                "nodeName": node_name,
                **body,
            },
        }
        for suffix, body in specs
    ]


def _counter_set(gpu: PublishedGpu) -> dict[str, Any]:
    model = gpu.model
    counters = {
        name: {"value": str(value)}
        for (_, name), value in zip(_CAPACITY_COUNTERS, _whole_gpu_amounts(model), strict=True)
    }
    for unit in range(model.memory_units):
        counters[memory_slice_counter(unit)] = {"value": "1"}
    if len(counters) > _MAX_COUNTERS_PER_SET:
        raise ValueError(
            f"{model.key} has {model.memory_units} memory units: {len(counters)} counters exceed "
            f"the API's {_MAX_COUNTERS_PER_SET} per counter set"
        )
    return {"name": counter_set_name(gpu.minor), "counters": counters}


def _whole_gpu_amounts(model: GpuModel) -> tuple[int, ...]:
    return (model.memory_mib * _MIB, model.multiprocessors, *model.engine_totals.counts())


def _profile_amounts(spec: ProfileSpec) -> tuple[int, ...]:
    return (spec.memory_mib * _MIB, spec.multiprocessors, *spec.engines.counts())


def _devices(gpu: PublishedGpu) -> list[dict[str, Any]]:
    """The GPU's devices in preference order.

    kube-scheduler takes the first device in a slice that matches a request and whose counters
    are free, so the order is the only placement policy the native path has. It is static (the
    scheduler knows nothing of the current state), so it is chosen against an empty GPU:

    * smaller profiles before larger ones, and profiles using fewer media engines before those
      using more, so that a request that matches several (a memory-capacity selector, say) gets
      the smallest device that satisfies it and leaves the OFA and decoders to those who ask;
    * within a profile, placements that leave the most room for big profiles first (compared
      by what the GPU still admits, biggest profile first), ties going to the higher start.
      On 8-unit GPUs this fills the upper half first, as NVML's own auto-placement does, so the
      4g (only at 0) and a 3g stay possible as long as possible;
    * the whole GPU last, because taking it blocks every MIG device.
    """
    model = gpu.model
    geometry = geometry_for(model)
    big_first = sorted(model.profiles, key=lambda p: (-p.size, -p.slices, -p.memory_mib, p.id))

    def room_left(spec: ProfileSpec, start: int) -> tuple[int, ...]:
        after = geometry.place(EMPTY_STATE, spec.id, start)
        admits = geometry.admits(after)
        return tuple(admits[p.id] for p in big_first)

    def footprint(spec: ProfileSpec) -> tuple[int, ...]:
        e = spec.engines
        media = e.decoders + e.encoders + e.jpeg + e.ofa
        return (spec.size, spec.memory_mib, spec.slices, spec.multiprocessors, media, spec.id)

    placements = sorted(
        ((spec, start) for spec in model.profiles for start in spec.starts),
        key=lambda ps: (
            footprint(ps[0]),
            tuple(-n for n in room_left(*ps)),
            -ps[1],
        ),
    )
    _check_placements_fit_alone(geometry, placements)
    devices = []
    if gpu.offers_mig:
        for spec, start in placements:
            device = _mig_device(gpu, spec, start)
            own = gpu.device_taints.get((spec.id, start), ())
            if own:
                device["taints"] = [dict(t) for t in own]
            devices.append(device)
    if gpu.offers_whole:
        device = _whole_gpu_device(gpu)
        if gpu.whole_taints:
            device["taints"] = [dict(t) for t in gpu.whole_taints]
        devices.append(device)
    if gpu.taints:
        for d in devices:
            mine = d.get("taints", [])
            d["taints"] = [dict(t) for t in gpu.taints] + [t for t in mine if t not in gpu.taints][
                : max(0, _MAX_TAINTS - len(gpu.taints))
            ]
    return devices


def _check_placements_fit_alone(
    geometry: Geometry, placements: Iterable[tuple[ProfileSpec, int]]
) -> None:
    for spec, start in placements:
        if not geometry.fits(EMPTY_STATE, spec.id, start):
            raise ValueError(
                f"{geometry.model.key}: {spec.name} at {start} cannot be created even on an "
                "empty GPU (placement outside the memory units or engines beyond the GPU's "
                "totals); refusing to publish a device that can never be carved"
            )


def _common_attributes(gpu: PublishedGpu) -> dict[str, dict[str, Any]]:
    """What every device of the GPU says about it: NVIDIA's DRA driver's set for GPU and MIG
    devices (deviceinfo.go, mig.go `CommonAttributesMig`), names and types alike, so a selector
    or `matchAttribute` written for it reads the same thing here."""
    model = gpu.model
    major, minor = model.cuda_compute_capability
    attributes: dict[str, dict[str, Any]] = {
        Attr.PRODUCT_NAME: _string(model.product_name),
        Attr.ARCHITECTURE: _string(str(model.architecture)),
        Attr.CUDA_COMPUTE_CAPABILITY: {"version": f"{major}.{minor}.0"},
        Attr.DRIVER_VERSION: {"version": _semver(gpu.driver_version)},
        PCI_BUS_ID_ATTRIBUTE: _string(standard_bus_id(gpu.pci_bus_id)),
    }
    if gpu.brand is not None:
        attributes[Attr.BRAND] = _string(gpu.brand)
    if gpu.cuda_driver_version is not None:
        attributes[Attr.CUDA_DRIVER_VERSION] = {"version": _semver(gpu.cuda_driver_version)}
    if gpu.addressing_mode is not None:
        attributes[Attr.ADDRESSING_MODE] = _string(gpu.addressing_mode)
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = _string(gpu.pcie_root)
    if gpu.numa_node is not None:
        if gpu.numa_node < 0:
            raise ValueError(f"GPU {gpu.minor}: NUMA node {gpu.numa_node} is negative")
        attributes[NUMA_NODE_ATTRIBUTE] = {"int": gpu.numa_node}
    return attributes


def _capacity(amounts: tuple[int, ...]) -> dict[str, dict[str, str]]:
    return {cap: {"value": str(v)} for (cap, _), v in zip(_CAPACITY_COUNTERS, amounts, strict=True)}


def _consumption(counter_set: str, amounts: tuple[int, ...], units: range) -> list[Any]:
    counters = {
        name: {"value": str(v)}
        for (_, name), v in zip(_CAPACITY_COUNTERS, amounts, strict=True)
        if v
    }
    counters.update({memory_slice_counter(u): {"value": "1"} for u in units})
    return [{"counterSet": counter_set, "counters": counters}]


def _mig_device(gpu: PublishedGpu, spec: ProfileSpec, start: int) -> dict[str, Any]:
    amounts = _profile_amounts(spec)
    attributes: dict[str, dict[str, Any]] = {
        Attr.TYPE: _string("mig"),
        Attr.PROFILE: _string(spec.name),
        Attr.PROFILE_ID: {"int": spec.id},
        # carve extras beyond the NVIDIA set, so the controller can rebuild the exact geometry
        Attr.PROFILE_INDEX: {"int": spec.index},
        Attr.MAX_INSTANCES: {"int": spec.max_instances},
        Attr.PLACEMENT_START: {"int": start},
        Attr.PLACEMENT_SIZE: {"int": spec.size},
        Attr.PARENT_UUID: _string(gpu.uuid),
        **_common_attributes(gpu),
    }
    return _device(
        mig_device_name(gpu.minor, spec.name, spec.id, start),
        attributes,
        _capacity(amounts),
        _consumption(counter_set_name(gpu.minor), amounts, range(start, start + spec.size)),
    )


def _whole_gpu_device(gpu: PublishedGpu) -> dict[str, Any]:
    amounts = _whole_gpu_amounts(gpu.model)
    attributes = {
        Attr.TYPE: _string("gpu"),
        Attr.UUID: _string(gpu.uuid),
        **_common_attributes(gpu),
    }
    return _device(
        gpu_device_name(gpu.minor),
        attributes,
        _capacity(amounts),
        _consumption(counter_set_name(gpu.minor), amounts, range(gpu.model.memory_units)),
    )


def _device(
    name: str,
    attributes: dict[str, dict[str, Any]],
    capacity: dict[str, dict[str, str]],
    consumes: list[Any],
) -> dict[str, Any]:
    if len(attributes) + len(capacity) > _MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(
            f"device {name}: {len(attributes)} attributes + {len(capacity)} capacities exceed "
            f"the API's {_MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    return {
        "name": name,
        "attributes": attributes,
        "capacity": capacity,
        "consumesCounters": consumes,
    }


def _string(value: str) -> dict[str, str]:
    if len(value) > _MAX_ATTRIBUTE_STRING:
        raise ValueError(
            f"attribute value {value!r} is longer than the API's {_MAX_ATTRIBUTE_STRING} chars"
        )
    return {"string": value}


def _semver(version: str) -> str:
    """NVML's driver ("580.105.08") and CUDA ("13.0") versions as the semver DRA version
    attributes require ("580.105.8", "13.0.0": no leading zeros, exactly three parts)."""
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"driver version {version!r} is not of the form N[.N[.N]]")
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    text = ".".join(map(str, numbers))
    if len(text) > _MAX_ATTRIBUTE_STRING:
        raise ValueError(f"driver version {version!r} is too long for a version attribute")
    return text


def _slice_name(node_name: str, driver: str, suffix: str) -> str:
    """`<node>-<driver>-<suffix>`, shortened with a hash when it would exceed 253 chars."""
    name = f"{node_name}-{driver}-{suffix}"
    if len(name) <= _MAX_OBJECT_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    keep = _MAX_OBJECT_NAME - len(suffix) - len(digest) - 2
    head = node_name[:keep].rstrip(".-")
    return f"{head}-{digest}-{suffix}"


def _check_dns_subdomain(what: str, value: str, limit: int) -> None:
    if len(value) > limit or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a DNS subdomain of at most {limit} characters")


def _check_unique(what: str, values: Sequence[object]) -> None:
    dupes = sorted({str(v) for v in values if values.count(v) > 1})
    if dupes:
        raise ValueError(f"duplicate {what}: {', '.join(dupes)}")


# ---- parsing --------------------------------------------------------------------------------

_QUANTITY = re.compile(
    r"(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<dec>[numkMGTPE])|[eE](?P<exp>[+-]?\d+))?"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: object) -> int:
    """A Kubernetes Quantity ("40Gi", "42949672960", "1e3", 7) as an exact integer.

    The apiserver may hand back a canonical form different from what was written, so every
    suffix is accepted; fractional results are rejected since carve counts whole units.
    """
    if isinstance(value, bool):
        raise ValueError(f"quantity {value!r} is not a number")
    if isinstance(value, int):
        return value
    if not isinstance(value, str) or not (m := _QUANTITY.fullmatch(value.strip())):
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    try:
        number = Decimal(m["num"])
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from err
    if m["bin"]:
        number *= 1 << _BINARY[m["bin"]]
    elif m["dec"]:
        number *= Decimal(10) ** _DECIMAL[m["dec"]]
    elif m["exp"]:
        number *= Decimal(10) ** int(m["exp"])
    if number != number.to_integral_value():
        raise ValueError(f"quantity {value!r} is not a whole number")
    return int(number)


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
    for name, _ in _CAPACITY_COUNTERS:
        entry = cap.get(name)
        if not isinstance(entry, Mapping) or "value" not in entry:
            raise ValueError(f"device {dev['name']!r} lacks capacity {name!r}")
        values.append(parse_quantity(entry["value"]))
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
        values[str(key)] = parse_quantity(counter["value"])
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
    units = sorted(int(m[1]) for k in counters if (m := _MEMORY_SLICE.fullmatch(k)))
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
    slices_used = sorted(int(m[1]) for k in used if (m := _MEMORY_SLICE.fullmatch(k)))
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
