"""The Alibaba GPU cluster trace (cluster-trace-gpu-v2023) and its mapping onto MIG.

Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent", USENIX ATC '23, published the trace (github.com/alibaba/clusterdata); a copy
lies in ../shared/traces/alibaba-gpu-v2023/ with a README that suggests the mapping used here.

The trace's GPUs are not MIG-capable, so every figure carries this mapping (``MAPPING_TEXT``):

- nodes keep their CPU, memory and GPU count; the GPU model becomes a MIG-capable catalogue
  model (``MODEL_MAP``): P100, T4, A10 -> A30-24GB; V100M16 -> A100-SXM4-40GB; V100M32 ->
  A100-SXM4-80GB; G1 -> A100-SXM4-80GB; G2 -> H100-SXM5-80GB; G3 -> H200-SXM5-141GB;
- a task with ``num_gpu == 1`` and ``gpu_milli < 1000`` asks for the smallest MIG profile whose
  compute share (slices / 7, or / 4 on A30) covers ``gpu_milli``, on whichever model it lands
  (plain profiles only, no ``+me``; among equal slices the least memory);
- ``gpu_milli == 1000`` asks for ``num_gpu`` whole GPUs on one node (a whole GPU takes every
  memory slice, as a 7g would);
- ``gpu_spec`` (allowed trace models, ``|``-separated, empty = any) keeps the catalogue models
  those trace models map to;
- tasks without GPUs (``num_gpu == 0``) are left out: neither placement engine places them;
- cpu_milli and memory_mib are the pod's requests, checked against the node (node fit).

Only the first five columns are required (``openb_pod_list_multigpu30.csv`` has no times);
``creation_time`` and ``deletion_time`` are read when present.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.catalog import GpuModel, ProfileSpec, gpu_model
from driver.contract import DEFAULT_CONTRACT

NODE_FILE = "openb_node_list_gpu_node.csv"
_TRACE = Path("traces") / "alibaba-gpu-v2023"


def _trace_dir() -> Path:
    """``$CARVE_TRACE_DIR``, else ``shared/`` beside the checkout, else the workplace's
    ``/work/shared`` (a clone made elsewhere, as CI's may be, still finds the trace)."""
    configured = os.environ.get("CARVE_TRACE_DIR")
    if configured:
        return Path(configured)
    beside = Path(__file__).resolve().parents[3] / "shared" / _TRACE
    for candidate in (beside, Path("/work/shared") / _TRACE):
        if (candidate / NODE_FILE).exists():
            return candidate
    return beside


TRACE_DIR = _trace_dir()
# Where the suites must run (CI), a missing trace fails the tests that need it instead of
# skipping them.
TRACE_REQUIRED = bool(os.environ.get("CARVE_REQUIRE_CLUSTER"))
DEFAULT_TASKS = "openb_pod_list_default.csv"
CITATION = (
    'Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with '
    "Fragmentation Gradient Descent\", USENIX ATC '23 (trace: github.com/alibaba/clusterdata, "
    "cluster-trace-gpu-v2023)"
)

MODEL_MAP: Mapping[str, str] = {
    "P100": "A30-24GB",
    "T4": "A30-24GB",
    "A10": "A30-24GB",
    "V100M16": "A100-SXM4-40GB",
    "V100M32": "A100-SXM4-80GB",
    "G1": "A100-SXM4-80GB",
    "G2": "H100-SXM5-80GB",
    "G3": "H200-SXM5-141GB",
}

MAPPING_TEXT = (
    "nodes keep cpu, memory and GPU count; P100/T4/A10 -> A30-24GB, V100M16 -> A100-SXM4-40GB, "
    "V100M32/G1 -> A100-SXM4-80GB, G2 -> H100-SXM5-80GB, G3 -> H200-SXM5-141GB; 1 GPU with "
    "gpu_milli < 1000 -> smallest plain MIG profile whose compute share covers it; gpu_milli "
    "1000 -> num_gpu whole GPUs on one node; CPU-only tasks left out; pod cpu/memory checked "
    "against the node"
)

REFERENCE_MODEL = "H100-SXM5-80GB"
"""The 7-slice, 8-unit model whose profile sizes define a task's share of a GPU: the share is
the same whichever model a task lands on, so a policy gains nothing by wasting space."""

DRIVER = DEFAULT_CONTRACT.driver
MIG_CLASS = DEFAULT_CONTRACT.mig_class
GPU_CLASS = DEFAULT_CONTRACT.gpu_class
_ATTR = f'device.attributes["{DRIVER}"]'


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # the trace's GPU model (P100, G2, ...)


@dataclass(frozen=True)
class TraceTask:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]  # allowed trace models; () = any
    creation: int | None  # seconds; None when the file has no times
    deletion: int | None


def _int(row: Mapping[str, str], column: str) -> int:
    return int(float(row[column]))


def _opt_int(row: Mapping[str, str | None], column: str) -> int | None:
    value = row.get(column)
    return int(float(value)) if value not in (None, "") else None


def load_nodes(path: Path) -> list[TraceNode]:
    with path.open(newline="") as f:
        return [
            TraceNode(
                row["sn"],
                _int(row, "cpu_milli"),
                _int(row, "memory_mib"),
                _int(row, "gpu"),
                row["model"].strip(),
            )
            for row in csv.DictReader(f)
        ]


def load_tasks(path: Path) -> list[TraceTask]:
    """Tasks in file order (the trace's own order: by creation time)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"} - set(
            reader.fieldnames or ()
        )
        if missing:
            raise ValueError(f"{path}: not a trace task list, lacks {', '.join(sorted(missing))}")
        tasks = []
        for row in reader:
            spec = (row.get("gpu_spec") or "").strip()
            tasks.append(
                TraceTask(
                    row["name"],
                    _int(row, "cpu_milli"),
                    _int(row, "memory_mib"),
                    _int(row, "num_gpu"),
                    _int(row, "gpu_milli"),
                    tuple(s.strip() for s in spec.split("|") if s.strip()),
                    _opt_int(row, "creation_time"),
                    _opt_int(row, "deletion_time"),
                )
            )
        return tasks


def catalogue_model(trace_model: str) -> GpuModel:
    try:
        return gpu_model(MODEL_MAP[trace_model])
    except KeyError:
        raise ValueError(
            f"trace GPU model {trace_model!r} has no mapping; known: {', '.join(MODEL_MAP)}"
        ) from None


def _plain(profile: ProfileSpec) -> bool:
    return "+" not in profile.name and not profile.name.endswith("-me")


def smallest_profile(model: GpuModel, gpu_milli: int) -> ProfileSpec:
    """The smallest plain profile of ``model`` whose compute share covers ``gpu_milli``."""
    covering = [
        p
        for p in model.profiles
        if _plain(p) and p.slices * 1000 >= gpu_milli * model.compute_slices
    ]
    return min(covering, key=lambda p: (p.slices, p.size, p.memory_mib, p.id))


@dataclass(frozen=True)
class MappedRequest:
    """What one task asks for after the mapping.

    ``whole`` tasks ask for ``count`` whole GPUs of any of ``models``; the others for one MIG
    device, ``profiles[model key]`` on each allowed model. ``share`` is the task's size in GPUs
    on the reference model (1/8 per memory unit; ``count`` for whole GPUs)."""

    whole: bool
    count: int
    models: tuple[str, ...]  # allowed catalogue model keys, sorted
    profiles: tuple[tuple[str, str], ...]  # (model key, profile name), MIG requests only
    share: float

    @property
    def shape(self) -> str:
        """A short name for tables: ``gpu x2``, ``4g`` (the reference profile's slices)."""
        if self.whole:
            return f"gpu x{self.count}"
        ref = dict(self.profiles).get(REFERENCE_MODEL)
        return (ref or self.profiles[0][1]).split(".", 1)[0]

    def profile_on(self, model_key: str) -> str | None:
        return dict(self.profiles).get(model_key)


def map_task(task: TraceTask, cluster_models: Iterable[str]) -> MappedRequest | None:
    """The task's request on a cluster with ``cluster_models``; None for a CPU-only task."""
    if task.num_gpu <= 0:
        return None
    present = sorted(set(cluster_models))
    if task.gpu_spec:
        allowed_keys = {MODEL_MAP[s] for s in task.gpu_spec if s in MODEL_MAP}
        models = tuple(k for k in present if k in allowed_keys)
    else:
        models = tuple(present)
    reference = gpu_model(REFERENCE_MODEL)
    if task.gpu_milli >= 1000 or task.num_gpu > 1:
        return MappedRequest(True, task.num_gpu, models, (), float(task.num_gpu))
    profiles = tuple((k, smallest_profile(gpu_model(k), task.gpu_milli).name) for k in models)
    ref = smallest_profile(reference, task.gpu_milli)
    return MappedRequest(False, 1, models, profiles, ref.size / reference.memory_units)


def claim_spec(request: MappedRequest) -> dict[str, Any]:
    """The ResourceClaim ``spec`` a user would write for the mapped request: one request, a
    CEL selector naming the profile per model (or the allowed models of a whole GPU)."""
    if request.whole:
        exactly: dict[str, Any] = {"deviceClassName": GPU_CLASS, "count": request.count}
        if request.models != tuple(sorted(request.models)) or not request.models:
            raise ValueError("models must be sorted and non-empty")
        names = ", ".join(f'"{gpu_model(k).product_name}"' for k in request.models)
        exactly["selectors"] = [{"cel": {"expression": f"{_ATTR}.productName in [{names}]"}}]
    else:
        clauses = [
            f'({_ATTR}.productName == "{gpu_model(k).product_name}" && '
            f'{_ATTR}.profile == "{profile}")'
            for k, profile in request.profiles
        ]
        exactly = {
            "deviceClassName": MIG_CLASS,
            "count": 1,
            "selectors": [{"cel": {"expression": " || ".join(clauses)}}],
        }
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def offered_share(requests: Sequence[MappedRequest]) -> float:
    return sum(r.share for r in requests)
