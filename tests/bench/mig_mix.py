"""MIG-native workload mixes for ``python -m bench.cluster_packing --mix NAME --seed N``.

The Alibaba trace makes almost every task a whole GPU or a half, so any policy packs it near
the bound. A cluster bought for MIG runs something else: many small inference slices that come
and go, a few big slices, and now and then a training job that wants several whole GPUs on one
node, on a fleet of several GPU generations. Placement matters there, because small slices
scattered over many GPUs and nodes leave no room for the big jobs.

A :class:`Mix` is data, every number with the reason it has (``why``); ``--list-mixes`` prints
the names, the default first, and ``describe_mix`` prints a mix in full with every run.

**How a mix becomes jobs** (:func:`mix_workload`), drawn from one ``random.Random(seed)``:

- the fleet: ``nodes`` nodes, each of one GPU model, the models in the proportions of
  ``Mix.fleet`` (largest remainder, then interleaved so that every stretch of node names has
  the mix); a node has that entry's GPUs, cpu and memory;
- arrivals: a Poisson process (exponential gaps), then compressed to ``jobs / rate`` seconds
  by ``tests.bench.cluster_workload.timed``;
- each arrival's class is drawn by ``JobClass.weight``; its request is
  ``compute`` sevenths of a GPU: on each allowed model the smallest plain MIG profile whose
  compute share covers it (the Alibaba mapping's rule, ``tests.bench.alibaba.smallest_profile``:
  a 3g job is a 3g.40gb on an H100 and a 2g.12gb on an A30), or ``gpus`` whole GPUs on one
  node for a multi-GPU class (its count drawn uniformly from ``gpus``);
- its raw lifetime is log-normal: ``median_life`` times ``exp(sigma * N(0, 1))``, then scaled
  by the run's one factor (``cluster_workload.Timing``) and clamped;
- its pod asks ``cpu_milli`` and ``memory_mib`` (per GPU for whole GPUs).

The claim a job makes is ``tests.bench.alibaba.claim_spec`` of its request: one request with a
CEL selector naming the profile per model (or the allowed product names of whole GPUs), the
same text for carve and for kube-scheduler's native path.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from driver.catalog import gpu_model
from tests.bench.alibaba import REFERENCE_MODEL, MappedRequest, smallest_profile
from tests.bench.cluster_workload import NodeSpec, RawJob, Timing, Workload, timed

_GIB = 1024


@dataclass(frozen=True)
class FleetShare:
    """One kind of node in the fleet."""

    model: str  # catalogue key
    fraction: float  # of the nodes
    gpus: int
    cpu_milli: int
    memory_mib: int
    why: str


@dataclass(frozen=True)
class JobClass:
    """One kind of job in the mix."""

    name: str
    weight: float  # fraction of arrivals
    compute: int  # sevenths of a GPU (1..7) for a MIG slice; 0 for whole GPUs
    gpus: tuple[int, ...]  # whole-GPU counts, drawn uniformly (compute == 0 only)
    models: tuple[str, ...]  # catalogue keys it may run on
    cpu_milli: int  # per job, or per GPU for whole GPUs
    memory_mib: int  # likewise
    median_life: float  # relative to the other classes; the run scales them all together
    sigma: float  # log-normal spread of the lifetime
    why: str


@dataclass(frozen=True)
class Mix:
    name: str
    summary: str
    fleet: tuple[FleetShare, ...]
    classes: tuple[JobClass, ...]


_BIG = ("A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM5-141GB")
_ALL = (*_BIG, "A30-24GB")
_TRAINING = ("A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM5-141GB")

_FLEET = (
    FleetShare(
        "A100-SXM4-40GB",
        0.15,
        8,
        192_000,
        1024 * _GIB,
        "the oldest 8-GPU generation still bought for MIG; 40 GB GPUs halve every slice's memory",
    ),
    FleetShare(
        "A100-SXM4-80GB",
        0.25,
        8,
        192_000,
        2048 * _GIB,
        "the most common MIG-capable data-centre GPU",
    ),
    FleetShare(
        "H100-SXM5-80GB",
        0.30,
        8,
        192_000,
        2048 * _GIB,
        "the current generation, the largest share of a fleet being built",
    ),
    FleetShare(
        "H200-SXM5-141GB",
        0.10,
        8,
        192_000,
        2048 * _GIB,
        "the newest and scarcest: a policy that wastes it shows",
    ),
    FleetShare(
        "A30-24GB",
        0.20,
        8,
        96_000,
        512 * _GIB,
        "inference nodes with 4-slice GPUs: a 3g or 4g job takes a whole A30, a 1g a quarter",
    ),
)

INFERENCE = Mix(
    "inference",
    "mostly 1g/2g inference slices that come and go, some 3g/4g, some 7g, 2% multi-GPU "
    "training jobs of 4 or 8 whole GPUs that live long; A100-40GB, A100-80GB, H100, H200, A30",
    _FLEET,
    (
        JobClass(
            "1g inference",
            0.50,
            1,
            (),
            _ALL,
            3_000,
            12 * _GIB,
            1.0,
            1.0,
            "small models served from one slice; the most frequent request in MIG clusters",
        ),
        JobClass(
            "2g inference",
            0.28,
            2,
            (),
            _ALL,
            6_000,
            24 * _GIB,
            1.0,
            1.0,
            "mid-size models; with 1g they are 'mostly 1g/2g'",
        ),
        JobClass(
            "3g fine-tune",
            0.07,
            3,
            (),
            _BIG,
            9_000,
            48 * _GIB,
            1.5,
            1.0,
            "notebooks and fine-tuning on half a GPU; not on A30s, whose half has 12 GB",
        ),
        JobClass(
            "4g fine-tune",
            0.05,
            4,
            (),
            _BIG,
            12_000,
            48 * _GIB,
            1.5,
            1.0,
            "the other half; a 4g and a 3g fill an 8-slice GPU only when placed as a pair",
        ),
        JobClass(
            "7g",
            0.08,
            7,
            (),
            _BIG,
            21_000,
            96 * _GIB,
            2.0,
            1.0,
            "a whole GPU in MIG mode (7g slice): needs a GPU with nothing else on it",
        ),
        JobClass(
            "multi-GPU training",
            0.02,
            0,
            (4, 8),
            _TRAINING,
            24_000,
            128 * _GIB,
            6.0,
            0.5,
            "data-parallel training on 4 or 8 whole 80 GB+ GPUs of one node; rare (2% of "
            "arrivals) but about half the GPU-time, and the jobs that starve when small slices "
            "are spread over every node",
        ),
    ),
)

MIXES: tuple[Mix, ...] = (INFERENCE,)
"""Every mix ``--mix`` accepts; the first is the default."""


def mix_named(name: str) -> Mix:
    for m in MIXES:
        if m.name == name:
            return m
    raise ValueError(f"no mix named {name!r}; known: {', '.join(m.name for m in MIXES)}")


def fleet(mix: Mix, nodes: int) -> tuple[NodeSpec, ...]:
    """``nodes`` nodes in the mix's proportions (largest remainder), interleaved by model."""
    total = sum(f.fraction for f in mix.fleet)
    exact = [nodes * f.fraction / total for f in mix.fleet]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: nodes - sum(counts)]:
        counts[i] += 1
    # Interleave: node i goes to the entry furthest behind its proportion so far.
    out: list[NodeSpec] = []
    given = [0] * len(counts)
    for i in range(nodes):
        pick = min(
            (j for j in range(len(counts)) if given[j] < counts[j]),
            key=lambda j: ((given[j] + 0.5) / counts[j], j),
        )
        f = mix.fleet[pick]
        given[pick] += 1
        short = f.model.split("-")[0].lower()
        out.append(NodeSpec(f"{short}-{i:04d}", f.model, f.gpus, f.cpu_milli, f.memory_mib))
    return tuple(out)


def _slice_request(compute: int, models: Sequence[str]) -> MappedRequest:
    milli = 1000 * compute // 7  # 1/7 -> 142: covered by a 1g (1000 >= 994), not by less
    profiles = tuple((k, smallest_profile(gpu_model(k), milli).name) for k in sorted(models))
    ref = gpu_model(REFERENCE_MODEL)
    share = smallest_profile(ref, milli).size / ref.memory_units
    return MappedRequest(False, 1, tuple(sorted(models)), profiles, share)


def _whole_request(count: int, models: Sequence[str]) -> MappedRequest:
    return MappedRequest(True, count, tuple(sorted(models)), (), float(count))


def mix_workload(mix: Mix, nodes: int, timing: Timing, seed: int) -> Workload:
    """The mix's fleet and ``timing.jobs`` jobs; see the module docstring."""
    specs = fleet(mix, nodes)
    present = {n.model for n in specs}
    rng = random.Random(seed)
    weights = [c.weight for c in mix.classes]
    raw: list[RawJob] = []
    clock = 0.0
    for i in range(timing.jobs):
        clock += rng.expovariate(1.0)
        c = rng.choices(mix.classes, weights)[0]
        models = [m for m in c.models if m in present]
        if not models:
            raise ValueError(f"mix {mix.name}: class {c.name!r} has no model in this fleet")
        if c.compute:
            request = _slice_request(c.compute, models)
            cpu, memory = c.cpu_milli, c.memory_mib
        else:
            count = rng.choice(c.gpus)
            request = _whole_request(count, models)
            cpu, memory = c.cpu_milli * count, c.memory_mib * count
        life = c.median_life * math.exp(c.sigma * rng.gauss(0.0, 1.0))
        raw.append(RawJob(f"j{i:05d}", request, cpu, memory, clock, life))
    gpus = sum(n.gpus for n in specs)
    jobs, k = timed(raw, gpus, timing)
    description = f"mix {mix.name} (seed {seed}): {mix.summary}"
    return Workload(f"mix {mix.name}", description, specs, tuple(jobs), k, timing.window_from)


def describe_mix(mix: Mix) -> list[str]:
    """Every parameter of the mix and why, one line each."""
    lines = [f"mix {mix.name}: {mix.summary}", "  fleet (fraction of nodes):"]
    for f in mix.fleet:
        lines.append(
            f"    {f.model}: {f.fraction:.0%}, {f.gpus} GPUs, {f.cpu_milli // 1000} cpu, "
            f"{f.memory_mib // _GIB} GiB; {f.why}"
        )
    lines.append("  jobs (fraction of arrivals; lifetime median relative, log-normal sigma):")
    for c in mix.classes:
        size = f"{c.compute}g slice" if c.compute else f"{' or '.join(map(str, c.gpus))} GPUs"
        per = " per GPU" if not c.compute else ""
        lines.append(
            f"    {c.name}: {c.weight:.0%}, {size} on {', '.join(c.models)}; "
            f"{c.cpu_milli / 1000:g} cpu and {c.memory_mib // _GIB} GiB{per}; "
            f"life x{c.median_life:g} (sigma {c.sigma:g}); {c.why}"
        )
    return lines
