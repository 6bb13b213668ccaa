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

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.catalog import (
    GpuModel,
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
)
from driver.pcie import standard_bus_id

__all__ = [
    "API_VERSION",
    "CAPACITY_COUNTERS",
    "MAX_DEVICES_PER_SLICE",
    "MEMORY_SLICE",
    "PublishedGpu",
    "build_resource_slices",
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
CAPACITY_COUNTERS = (
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
MEMORY_SLICE = re.compile(r"memory-slice-(0|[1-9][0-9]*)")


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
        for (_, name), value in zip(CAPACITY_COUNTERS, _whole_gpu_amounts(model), strict=True)
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
    return {cap: {"value": str(v)} for (cap, _), v in zip(CAPACITY_COUNTERS, amounts, strict=True)}


def _consumption(counter_set: str, amounts: tuple[int, ...], units: range) -> list[Any]:
    counters = {
        name: {"value": str(v)}
        for (_, name), v in zip(CAPACITY_COUNTERS, amounts, strict=True)
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
