"""Packing benchmark: carve's best fit against the peers' first fit on one seeded trace.

    python -m bench.packing                # defaults: packing on 64 nodes, timing on 1000 x 8
    python -m bench.packing --help

Both policies see exactly the same arrivals (pods asking for one MIG profile by name, on a mix
of GPU models) and departures (a pod leaves after its lifetime, if it was placed). Figures:

- placed: fraction of arrivals that got a slice at arrival time (no queueing, so the number
  isolates the packing decision); placed-units weighs each arrival by its memory units, so a
  policy cannot look good by turning big requests away;
- utilization: occupied memory units / all memory units, averaged over arrivals after warm-up;
- fragmentation: of the free memory units, the fraction that cannot be used by the largest
  profile still creatable on their GPU, i.e. 1 - sum(size of largest creatable profile) /
  sum(free units), averaged like utilization. 0 means every GPU's free space is one usable
  block; high values mean free space is scattered in holes that big profiles cannot use;
- decisions/s and p50/p99 decision time of ``PlacementEngine.place`` on a cluster of
  ``--timing-nodes`` x ``--gpus-per-node`` GPUs kept at the trace's load.

This module also builds synthetic GPU inventories the way the kubelet plugin publishes them;
the controller tests reuse those builders.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from controller.nodefit import NodeInfo, PodNeeds, Resources
from controller.placement import (
    ClaimToPlace,
    NoPlacement,
    Placement,
    PlacementEngine,
    PlacementRequest,
    Policy,
)
from driver.catalog import GpuModel, gpu_model
from driver.cel import CelDevice, Semver
from driver.geometry import geometry_for
from driver.naming import gpu_device_name, mig_device_name

DRIVER = "mig.carve.dev"
MIG_CLASS = DeviceClass("mig.carve.dev", ('device.attributes["mig.carve.dev"].type == "mig"',))
GPU_CLASS = DeviceClass("gpu.carve.dev", ('device.attributes["mig.carve.dev"].type == "gpu"',))
CLASSES = {c.name: c for c in (MIG_CLASS, GPU_CLASS)}
MIB = 2**20


# ---------------------------------------------------------------------------------------------
# Inventories as the plugin publishes them


def build_gpu(node: str, minor: int, model: GpuModel, driver: str = DRIVER) -> GpuInventory:
    """One GPU with a device per (profile, placement) plus the whole GPU."""
    uuid = f"GPU-{node}-{minor}"
    common = {
        "productName": model.product_name,
        "architecture": model.architecture.value,
        "cudaComputeCapability": Semver(*model.cuda_compute_capability, 0),
        "driverVersion": Semver(580, 65, 6),
        "resource.kubernetes.io/pciBusID": f"0000:{minor + 0x10:02x}:00.0",
    }
    devices = [
        PublishedDevice(
            gpu_device_name(minor),
            WHOLE_GPU,
            0,
            CelDevice.of(
                driver,
                {**common, "type": "gpu", "uuid": uuid},
                {
                    "memory": Decimal(model.memory_mib * MIB),
                    "multiprocessors": Decimal(model.multiprocessors),
                },
            ),
        )
    ]
    for p in model.profiles:
        for pl in p.placements:
            devices.append(
                PublishedDevice(
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
                            "parentUUID": uuid,
                        },
                        {
                            "memory": Decimal(p.memory_mib * MIB),
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
    return GpuInventory(node, node, uuid, model, tuple(devices))


def node_info(name: str, cpu: int = 64, memory_gib: int = 512, pods: int = 110) -> NodeInfo:
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


def profile_claim(name: str, profile: str, count: int = 1) -> ClaimToPlace:
    selector = f'device.attributes["mig.carve.dev"].profile == "{profile}"'
    spec = ClaimSpec(
        (
            DeviceRequest(
                "gpu",
                (Alternative("gpu", ExactRequest("mig.carve.dev", (selector,), count=count)),),
            ),
        )
    )
    return ClaimToPlace(ClaimKey("bench", name, name), spec)


# ---------------------------------------------------------------------------------------------
# The trace


@dataclass(frozen=True)
class Arrival:
    time: float
    pod: str
    profile: str
    lifetime: float


DEFAULT_MODELS = ("A100-SXM4-80GB", "H100-SXM5-80GB", "A100-SXM4-40GB")
# Profile names and their weight in the mix; names shared by several models let the engine
# choose the model. Small slices dominate, as in inference-heavy clusters.
DEFAULT_MIX = (
    ("1g.10gb", 30),
    ("1g.20gb", 10),
    ("2g.20gb", 15),
    ("3g.40gb", 15),
    ("4g.40gb", 5),
    ("7g.80gb", 5),
    ("1g.5gb", 10),
    ("2g.10gb", 5),
    ("3g.20gb", 5),
)


def make_trace(
    seed: int, arrivals: int, capacity_units: int, load: float, mix: Sequence[tuple[str, int]]
) -> list[Arrival]:
    """Poisson arrivals whose offered load is ``load`` x the cluster's memory units."""
    rng = random.Random(seed)
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    sizes = {"1g": 1, "2g": 2, "3g": 4, "4g": 4, "7g": 8}
    mean_size = sum(sizes[n[:2]] * (2 if n in ("1g.20gb",) else 1) * w for n, w in mix) / sum(
        weights
    )
    mean_life = 100.0
    rate = load * capacity_units / (mean_size * mean_life)
    t = 0.0
    out = []
    for i in range(arrivals):
        t += rng.expovariate(rate)
        out.append(
            Arrival(t, f"pod-{i}", rng.choices(names, weights)[0], rng.expovariate(1 / mean_life))
        )
    return out


@dataclass
class Figures:
    policy: Policy
    arrivals: int = 0
    placed: int = 0
    units_asked: int = 0
    units_placed: int = 0
    utilization: float = 0.0
    fragmentation: float = 0.0
    decisions: int = 0
    seconds: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0


def _occupancy_figures(model: ClusterModel) -> tuple[float, float]:
    used = total = free = usable = 0
    for record in model.gpus.values():
        units = record.inventory.model.memory_units
        total += units
        occ = record.occupancy
        if occ.blocked:
            used += units
            continue
        busy = bin(occ.state.occupied).count("1")
        used += busy
        free += units - busy
        geometry = record.geometry
        largest = 0
        for pid, n in geometry.admits(occ.state).items():
            if n:
                largest = max(largest, record.inventory.model.profile_by_id(pid).size)
        usable += largest
    return used / total, (1 - usable / free) if free else 0.0


def _profile_units(model: ClusterModel) -> dict[str, int]:
    models = {r.inventory.model.key: r.inventory.model for r in model.gpus.values()}
    return {p.name: p.size for m in models.values() for p in m.profiles}


def run_trace(
    model: ClusterModel,
    policy: Policy,
    trace: Sequence[Arrival],
    *,
    warmup: float = 0.2,
    sample_every: int = 1,
) -> Figures:
    engine = PlacementEngine(model, CLASSES, DRIVER, policy=policy)
    needs = PodNeeds(Resources(1000, 2**30, 1))
    figures = Figures(policy)
    live: list[tuple[float, str, Placement]] = []  # heap by end time
    import heapq

    times: list[float] = []
    util_samples: list[float] = []
    frag_samples: list[float] = []
    start_sampling = int(len(trace) * warmup)
    sizes = _profile_units(model)
    for i, a in enumerate(trace):
        while live and live[0][0] <= a.time:
            _, pod, placement = heapq.heappop(live)
            for hold in placement.holds():
                model.release(hold.claim)
            model.remove_pod(pod)
        request = PlacementRequest(a.pod, needs, (profile_claim(a.pod, a.profile),))
        t0 = time.perf_counter()
        result = engine.place(request)
        times.append(time.perf_counter() - t0)
        figures.arrivals += 1
        size = sizes.get(a.profile, 0)
        figures.units_asked += size
        if not isinstance(result, NoPlacement):
            figures.placed += 1
            figures.units_placed += size
            engine.commit(result, a.pod, needs)
            heapq.heappush(live, (a.time + a.lifetime, a.pod, result))
        if i >= start_sampling and i % sample_every == 0:
            u, f = _occupancy_figures(model)
            util_samples.append(u)
            frag_samples.append(f)
    figures.utilization = statistics.fmean(util_samples) if util_samples else 0.0
    figures.fragmentation = statistics.fmean(frag_samples) if frag_samples else 0.0
    figures.decisions = len(times)
    figures.seconds = sum(times)
    ordered = sorted(times)
    figures.p50_ms = ordered[len(ordered) // 2] * 1000
    figures.p99_ms = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000
    return figures


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=64, help="nodes in the packing run")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--arrivals", type=int, default=5000, help="arrivals in the packing run")
    parser.add_argument("--load", type=float, default=1.2, help="offered load / capacity")
    parser.add_argument("--timing-nodes", type=int, default=1000)
    parser.add_argument("--timing-arrivals", type=int, default=12000)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    args = parser.parse_args(argv)

    models = [gpu_model(k) for k in args.models.split(",")]
    for m in models:
        geometry_for(m)

    def units(nodes: int) -> int:
        return sum(models[i % len(models)].memory_units for i in range(nodes)) * args.gpus_per_node

    print(
        f"packing: {args.nodes} nodes x {args.gpus_per_node} GPUs "
        f"({', '.join(m.key for m in models)}), {args.arrivals} arrivals, load {args.load}, "
        f"seed {args.seed}"
    )
    trace = make_trace(args.seed, args.arrivals, units(args.nodes), args.load, DEFAULT_MIX)
    results = []
    for policy in (Policy.BEST_FIT, Policy.FIRST_FIT):
        cluster = build_cluster(args.nodes, args.gpus_per_node, models)
        results.append(run_trace(cluster, policy, trace))
    _print_table(results, timing=False)

    print(
        f"\ntiming: {args.timing_nodes} nodes x {args.gpus_per_node} GPUs, "
        f"{args.timing_arrivals} arrivals, load {args.load}"
    )
    trace = make_trace(
        args.seed + 1, args.timing_arrivals, units(args.timing_nodes), args.load, DEFAULT_MIX
    )
    results = []
    for policy in (Policy.BEST_FIT, Policy.FIRST_FIT):
        t0 = time.perf_counter()
        cluster = build_cluster(args.timing_nodes, args.gpus_per_node, models)
        built = time.perf_counter() - t0
        print(f"  built {policy.value} cluster in {built:.1f}s")
        results.append(run_trace(cluster, policy, trace, sample_every=500))
    _print_table(results, timing=True)
    return 0


def _print_table(results: Sequence[Figures], *, timing: bool) -> None:
    header = f"  {'policy':<10} {'placed':>8} {'placed-units':>12} {'util':>7} {'frag':>7}"
    if timing:
        header += f" {'decisions/s':>12} {'p50 ms':>8} {'p99 ms':>8}"
    print(header)
    for f in results:
        line = (
            f"  {f.policy.value:<10} {f.placed / f.arrivals:>8.3f} "
            f"{f.units_placed / f.units_asked:>12.3f} {f.utilization:>7.3f} "
            f"{f.fragmentation:>7.3f}"
        )
        if timing:
            line += f" {f.decisions / f.seconds:>12.0f} {f.p50_ms:>8.3f} {f.p99_ms:>8.3f}"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
