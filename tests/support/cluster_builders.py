"""Synthetic GPUs, clusters and claims for tests and benchmarks of the placement engine.

The controller only ever sees GPUs through the devices the kubelet plugin publishes, so these
builders publish them the same way (see driver/resourceslice.py) without a plugin or an API
server. They live with the tests, not in bench/, because tests are their main user and a
test must never depend on a benchmark; `bench.packing` imports them from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from decimal import Decimal

from controller.claims import (
    Alternative,
    ClaimKey,
    ClaimSpec,
    DeviceClass,
    DeviceRequest,
    ExactRequest,
)
from controller.model import WHOLE_GPU, ClusterModel, GpuInventory, PublishedDevice
from controller.nodefit import NodeInfo, Resources
from controller.placement import ClaimToPlace
from driver.catalog import GpuModel
from driver.cel import CelDevice, Semver
from driver.contract import DEFAULT_CONTRACT
from driver.naming import gpu_device_name, mig_device_name

DRIVER = DEFAULT_CONTRACT.driver
_ATTRS = f'device.attributes["{DRIVER}"]'
MIG_CLASS = DeviceClass(DEFAULT_CONTRACT.mig_class, (f'{_ATTRS}.type == "mig"',))
GPU_CLASS = DeviceClass(DEFAULT_CONTRACT.gpu_class, (f'{_ATTRS}.type == "gpu"',))
CLASSES = {c.name: c for c in (MIG_CLASS, GPU_CLASS)}
_MIB = 2**20


def build_gpu(node: str, minor: int, model: GpuModel, driver: str = DRIVER) -> GpuInventory:
    """One GPU with a device per (profile, placement) plus the whole GPU, attributed as the
    kubelet plugin publishes them (see driver/resourceslice.py)."""
    uuid = f"GPU-{node}-{minor}"
    bus = f"0000:{minor + 0x10:02x}:00.0"
    template = _template(model, minor, driver)
    swap = {_TEMPLATE_UUID: uuid, _TEMPLATE_BUS: bus}
    devices = tuple(
        PublishedDevice(
            name,
            pid,
            start,
            CelDevice(
                facts.driver,
                tuple(
                    (k, swap.get(v, v) if isinstance(v, str) else v) for k, v in facts.attributes
                ),
                facts.capacity,
            ),
        )
        for name, pid, start, facts in template
    )
    return GpuInventory(node, node, uuid, model, devices)


_TEMPLATE_UUID = "GPU-@template"
_TEMPLATE_BUS = "@template-bus"
_TEMPLATES: dict[tuple[str, int, str], tuple[tuple[str, int, int, CelDevice], ...]] = {}


def _template(
    model: GpuModel, minor: int, driver: str
) -> tuple[tuple[str, int, int, CelDevice], ...]:
    """The devices of one GPU of ``model`` at ``minor`` with placeholder identity values, built
    once: sorting and qualifying attributes dominates building a 1,000-node cluster."""
    key = (model.key, minor, driver)
    hit = _TEMPLATES.get(key)
    if hit is not None:
        return hit
    common = {
        "productName": model.product_name,
        "architecture": model.architecture.value,
        "cudaComputeCapability": Semver(*model.cuda_compute_capability, 0),
        "driverVersion": Semver(580, 65, 6),
        "resource.kubernetes.io/pciBusID": _TEMPLATE_BUS,
    }
    devices = [
        (
            gpu_device_name(minor),
            WHOLE_GPU,
            0,
            CelDevice.of(
                driver,
                {**common, "type": "gpu", "uuid": _TEMPLATE_UUID},
                {
                    "memory": Decimal(model.memory_mib * _MIB),
                    "multiprocessors": Decimal(model.multiprocessors),
                },
            ),
        )
    ]
    for p in model.profiles:
        for pl in p.placements:
            devices.append(
                (
                    mig_device_name(minor, p.name, p.id, pl.start),
                    p.id,
                    pl.start,
                    CelDevice.of(
                        driver,
                        {
                            **common,
                            "type": "mig",
                            "profile": p.name,
                            "profileId": p.id,
                            "placementStart": pl.start,
                            "placementSize": pl.size,
                            "parentUUID": _TEMPLATE_UUID,
                        },
                        {
                            "memory": Decimal(p.memory_mib * _MIB),
                            "multiprocessors": Decimal(p.multiprocessors),
                            "copyEngines": Decimal(p.engines.copy),
                            "decoders": Decimal(p.engines.decoders),
                            "encoders": Decimal(p.engines.encoders),
                            "jpegEngines": Decimal(p.engines.jpeg),
                            "ofaEngines": Decimal(p.engines.ofa),
                        },
                    ),
                )
            )
    _TEMPLATES[key] = tuple(devices)
    return _TEMPLATES[key]


def node_info(name: str, cpu: int = 64, memory_gib: int = 512, pods: int = 110) -> NodeInfo:
    """A roomy node, so that placement tests fail on GPUs unless they ask for cpu or memory."""
    return NodeInfo(
        name,
        Resources(cpu * 1000, memory_gib * 2**30, pods),
        labels=(("kubernetes.io/hostname", name),),
    )


def build_cluster(
    nodes: int, gpus_per_node: int, models: Sequence[GpuModel], driver: str = DRIVER
) -> ClusterModel:
    """Nodes named node-0000...; node i carries models[i % len(models)]."""
    model = ClusterModel()
    for i in range(nodes):
        name = f"node-{i:04d}"
        model.set_node(node_info(name))
        gpu = models[i % len(models)]
        model.set_node_gpus(name, [build_gpu(name, m, gpu, driver) for m in range(gpus_per_node)])
    return model


def profile_selector(profile: str) -> str:
    """The CEL selector a claim uses to ask for one MIG profile by name."""
    return f'{_ATTRS}.profile == "{profile}"'


def profile_units(models: Iterable[GpuModel]) -> dict[str, int]:
    """Profile name -> the memory units a claim asking for it by name (:func:`profile_claim`)
    needs: the fewest among the ``models`` that offer the name.

    One name can mean different sizes on different models: a ``1g.10gb`` is one memory slice
    of an A100-80GB or an H100, but two of an A100-40GB. Weighing the request by where it could
    land cheapest keeps a benchmark's "placed units" a property of the request, so a policy
    gains nothing by landing it where it takes more room."""
    units: dict[str, int] = {}
    for model in models:
        for p in model.profiles:
            units[p.name] = min(units.get(p.name, p.size), p.size)
    return units


def profile_claim(name: str, profile: str, count: int = 1) -> ClaimToPlace:
    """A claim for ``count`` slices of one MIG profile, as a user's claim template asks."""
    selector = profile_selector(profile)
    spec = ClaimSpec(
        (
            DeviceRequest(
                "gpu",
                (
                    Alternative(
                        "gpu", ExactRequest(DEFAULT_CONTRACT.mig_class, (selector,), count=count)
                    ),
                ),
            ),
        )
    )
    return ClaimToPlace(ClaimKey("bench", name, name), spec)
