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

import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster import FEATURE_GATES, bin_dir, ensure_binaries
from driver.catalog import GpuModel
from driver.contract import DEFAULT_DRIVER_NAME
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
