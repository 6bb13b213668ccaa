"""kube-scheduler's structured DRA allocator, run on carve's own published ResourceSlices.

``hack/k8s/cmd/dra-allocate`` (built by hack/k8s/build.sh next to the control plane) wraps
``k8s.io/dynamic-resource-allocation/structured`` v0.37.2 as kube-scheduler v1.37.2 calls it:
same feature set (the scheduler's defaults, or the devcluster's gates), a fresh allocator per
claim fed the already-allocated devices, and the allocator's own counter accounting on carve's
``memory-slice-<i>`` counters. This module builds its input from
``driver.resourceslice.build_resource_slices`` and carve's DeviceClasses, and reads its verdicts.

It lives in tests.support (not bench) so both the benchmark (bench/real_allocator.py) and the
tests can use it: tests never import bench.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster import FEATURE_GATES, bin_dir, ensure_binaries
from driver.catalog import GpuModel
from driver.contract import DEFAULT_DRIVER_NAME
from driver.naming import parse_device_name
from driver.resourceslice import PublishedGpu, build_resource_slices

NODE = "baseline-node"
MIG_CLASS = "mig.carve.dev"
GPU_CLASS = "gpu.carve.dev"
BINARY_NAME = "dra-allocate"


def binary(*, build: bool = True) -> Path:
    """The dra-allocate binary, building the cache first if needed (BinariesUnavailableError
    when it cannot be built)."""
    ensure_binaries(build=build)
    return bin_dir() / BINARY_NAME


def device_classes(
    driver: str = DEFAULT_DRIVER_NAME, *, mig_class: str = MIG_CLASS, gpu_class: str = GPU_CLASS
) -> list[dict[str, Any]]:
    """carve's two DeviceClasses (deploy/manifests/10-deviceclasses.yaml) for `driver`."""

    def cls(name: str, kind: str) -> dict[str, Any]:
        expr = f'device.driver == "{driver}" && device.attributes["{driver}"].type == "{kind}"'
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expr}}]},
        }

    return [cls(mig_class, "mig"), cls(gpu_class, "gpu")]


def node_slices(
    models: Sequence[GpuModel], *, node: str = NODE, driver: str = DEFAULT_DRIVER_NAME
) -> list[dict[str, Any]]:
    """What carve's kubelet plugin publishes for a node with these GPUs (minors 0..n-1)."""
    gpus = [
        PublishedGpu(i, f"GPU-{node}-{i}", m, f"0000:{i + 1:02x}:00.0", "580.105.08")
        for i, m in enumerate(models)
    ]
    return build_resource_slices(driver=driver, node_name=node, pool_generation=1, gpus=gpus)


def profile_claim(
    name: str,
    profile: str,
    *,
    count: int = 1,
    driver: str = DEFAULT_DRIVER_NAME,
    device_class: str = MIG_CLASS,
    namespace: str = "default",
) -> dict[str, Any]:
    """A claim for `count` MIG devices of one profile, selected by name as users write it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": device_class,
                            "count": count,
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": f'device.attributes["{driver}"].profile'
                                        f' == "{profile}"'
                                    }
                                }
                            ],
                        },
                    }
                ]
            }
        },
    }


def allocate(claim: Mapping[str, Any]) -> dict[str, Any]:
    return {"allocate": dict(claim)}


def release(claim_name: str) -> dict[str, Any]:
    return {"release": claim_name}


@dataclass(frozen=True)
class Verdict:
    """One step's answer: status is allocated, unschedulable, error or released."""

    op: str
    claim: str
    status: str
    devices: tuple[str, ...]  # device names, in request-result order
    message: str

    @property
    def allocated(self) -> bool:
        return self.status == "allocated"


def scheduler_gates_flag(gates: Mapping[str, bool] = FEATURE_GATES) -> str:
    return ",".join(f"{n}={str(on).lower()}" for n, on in sorted(gates.items()))


def run_steps(
    slices: Sequence[Mapping[str, Any]],
    steps: Iterable[Mapping[str, Any]],
    *,
    node: str = NODE,
    classes: Sequence[Mapping[str, Any]] | None = None,
    feature_gates: Mapping[str, bool] | None = FEATURE_GATES,
    exe: Path | None = None,
    timeout: float = 120.0,
) -> list[Verdict]:
    """Run the allocator over `steps`; feature_gates None means kube-scheduler's defaults, the
    default is the devcluster's kube-scheduler flags."""
    payload = {
        "node": {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}},
        "slices": list(slices),
        "classes": list(classes if classes is not None else device_classes()),
        "steps": list(steps),
    }
    cmd = [str(exe if exe is not None else binary())]
    if feature_gates is not None:
        cmd.append("--feature-gates=" + scheduler_gates_flag(feature_gates))
    proc = subprocess.run(
        cmd,
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{BINARY_NAME} exited {proc.returncode}: {proc.stderr.strip()}")
    verdicts = []
    for line in proc.stdout.splitlines():
        o = json.loads(line)
        verdicts.append(
            Verdict(
                op=o["op"],
                claim=o["claim"],
                status=o["status"],
                devices=tuple(d["device"] for d in o.get("devices") or ()),
                message=o.get("message", ""),
            )
        )
    return verdicts


def device_claim(
    name: str, spec: Mapping[str, Any], *, namespace: str = "default"
) -> dict[str, Any]:
    """A ResourceClaim with ``spec`` (the ``spec`` object a user writes)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": dict(spec),
    }


MAX_REQUESTS_PER_CLAIM = 32
"""resource.k8s.io/v1 DeviceRequestsMaxSize: requests one claim may hold."""


def pin_claims(
    devices: Sequence[str],
    *,
    node: str = NODE,
    driver: str = DEFAULT_DRIVER_NAME,
    prefix: str = "pin",
) -> list[dict[str, Any]]:
    """Claims that can only get exactly ``devices`` (carve device names on ``node``'s slices
    from :func:`node_slices`): one request per device, its selector naming the GPU, profile
    and placement. Allocating them rebuilds an allocated state without replaying the history
    that led to it (the allocator reads only which devices are taken)."""
    attr = f'device.attributes["{driver}"]'
    requests = []
    for i, name in enumerate(devices):
        parsed = parse_device_name(name)
        uuid = f"GPU-{node}-{parsed.minor}"
        if parsed.profile_id is None:
            cls, expr = GPU_CLASS, f'{attr}.type == "gpu" && {attr}.uuid == "{uuid}"'
        else:
            cls = MIG_CLASS
            expr = (
                f'{attr}.type == "mig" && {attr}.parentUUID == "{uuid}" && '
                f"{attr}.profileId == {parsed.profile_id} && "
                f"{attr}.placementStart == {parsed.placement_start}"
            )
        requests.append(
            {
                "name": f"p{i}",
                "exactly": {"deviceClassName": cls, "selectors": [{"cel": {"expression": expr}}]},
            }
        )
    return [
        device_claim(
            f"{prefix}-{n}",
            {"devices": {"requests": requests[i : i + MAX_REQUESTS_PER_CLAIM]}},
        )
        for n, i in enumerate(range(0, len(requests), MAX_REQUESTS_PER_CLAIM))
    ]


def spec_key(spec: Mapping[str, Any]) -> str:
    """A claim spec as a canonical string (the cache key of :class:`CachedAllocator`)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


_StateKey = tuple[tuple[str, ...], frozenset[str], str]  # (GPU models, held devices, spec)


@dataclass
class AllocatorStats:
    runs: int = 0  # dra-allocate processes
    steps: int = 0
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0


class CachedAllocator:
    """kube-scheduler's allocator for one node at a time, remembered per allocated state.

    ``allocate(models, held, spec)`` answers which devices the real allocator gives a claim
    with ``spec`` on a node whose GPUs are ``models`` (minors 0..n-1) and whose devices
    ``held`` are taken, or None when it finds none. The answer depends on nothing else (every
    allocation builds a fresh allocator from the taken devices, as kube-scheduler does per pod),
    so it is remembered. A miss runs dra-allocate once: :func:`pin_claims` rebuild the state,
    then the asked spec and every spec in ``also`` are allocated and released in turn, so that
    the next question about the same state is answered without a process.
    """

    def __init__(
        self,
        exe: Path | None = None,
        *,
        feature_gates: Mapping[str, bool] | None = FEATURE_GATES,
        driver: str = DEFAULT_DRIVER_NAME,
    ) -> None:
        self.exe = exe if exe is not None else binary(build=False)
        self.feature_gates = feature_gates
        self.driver = driver
        self.stats = AllocatorStats()
        self._answers: dict[_StateKey, tuple[str, ...] | None] = {}
        self._slices: dict[tuple[str, ...], list[dict[str, Any]]] = {}

    def _identity(self) -> str:
        """What the answers depend on besides the question: the binary, its gates, the driver."""
        digest = hashlib.sha256(self.exe.read_bytes()).hexdigest()
        gates = "" if self.feature_gates is None else scheduler_gates_flag(self.feature_gates)
        return f"{digest} {gates} {self.driver}"

    def load(self, path: Path) -> int:
        """Answers saved by :meth:`save` with the same binary, gates and driver; how many."""
        if not path.exists():
            return 0
        data = json.loads(path.read_text())
        if data.get("identity") != self._identity():
            return 0
        for models, held, key, devices in data["answers"]:
            answer = tuple(devices) if devices is not None else None
            self._answers[(tuple(models), frozenset(held), key)] = answer
        return len(data["answers"])

    def save(self, path: Path) -> None:
        answers = [
            [list(models), sorted(held), key, list(devices) if devices is not None else None]
            for (models, held, key), devices in self._answers.items()
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self._identity(), "answers": answers}))
        tmp.replace(path)

    def allocate(
        self,
        models: Sequence[GpuModel],
        held: frozenset[str],
        spec: Mapping[str, Any],
        also: Iterable[Mapping[str, Any]] = (),
    ) -> tuple[str, ...] | None:
        keys = tuple(m.key for m in models)
        key = spec_key(spec)
        hit = self._answers.get((keys, held, key), False)
        if hit is not False:
            self.stats.hits += 1
            return hit
        self.stats.misses += 1
        specs = {key: spec}
        for other in also:
            k = spec_key(other)
            if (keys, held, k) not in self._answers:
                specs.setdefault(k, other)
        self._run(models, keys, held, specs)
        return self._answers[(keys, held, key)]

    def _run(
        self,
        models: Sequence[GpuModel],
        keys: tuple[str, ...],
        held: frozenset[str],
        specs: Mapping[str, Mapping[str, Any]],
    ) -> None:
        slices = self._slices.get(keys)
        if slices is None:
            slices = self._slices[keys] = node_slices(models, driver=self.driver)
        ordered_held = sorted(held)
        pins = pin_claims(ordered_held, driver=self.driver)
        steps: list[dict[str, Any]] = [allocate(p) for p in pins]
        names = list(specs)
        for i, k in enumerate(names):
            steps.append(allocate(device_claim(f"q-{i}", specs[k])))
            steps.append(release(f"q-{i}"))
        t0 = time.perf_counter()
        verdicts = run_steps(
            slices,
            steps,
            classes=device_classes(self.driver),
            feature_gates=self.feature_gates,
            exe=self.exe,
        )
        self.stats.seconds += time.perf_counter() - t0
        self.stats.runs += 1
        self.stats.steps += len(steps)
        pinned = [d for v in verdicts[: len(pins)] for d in v.devices]
        if sorted(pinned) != ordered_held or not all(v.allocated for v in verdicts[: len(pins)]):
            raise RuntimeError(
                f"{BINARY_NAME} did not rebuild the allocated state {ordered_held}: {pinned} "
                f"({[v.message for v in verdicts[: len(pins)] if not v.allocated]})"
            )
        for i, k in enumerate(names):
            v = verdicts[len(pins) + 2 * i]
            if v.status == "error":
                raise RuntimeError(f"{BINARY_NAME} failed on claim spec {k}: {v.message}")
            self._answers[(keys, held, k)] = v.devices if v.allocated else None
