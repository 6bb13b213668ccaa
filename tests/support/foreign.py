"""The foreign-objects benchmark's machinery (`python -m bench.foreign_objects` is the command
line): carve-controller against a real apiserver that also holds tens of thousands of another
driver's ResourceClaims and ResourceSlices (issue 30.6). The controller should keep none of
them: its resident memory and its decision time must not grow with them.

Measured per count of foreign objects, each with a fresh controller process (optionally one
from another source tree, e.g. a `git worktree` of main, to compare):
- start-up: process start to /readyz (every informer listed);
- RSS once ready, and the peak (VmHWM), from /proc;
- decision time: the controller's `carve_decision_seconds` (mean and p99) over a batch of gated
  pods placed on a small fake GPU fleet (`tests.support.gpufleet`).

`bytes_per_object` measures what the controller's caches keep of one object of each kind
(tracemalloc over the informers' transforms), a foreign claim included.

It lives here so that tests/bench/test_foreign_objects.py runs it at a small count (tests never
import bench/)."""

from __future__ import annotations

import contextlib
import math
import time
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.contract import DEFAULT_CONTRACT
from tests.support import promtext
from tests.support.gpufleet import GpuFleet, fleet_node, node_slices
from tests.support.scale_pods import claim_template, pod_manifest
from tests.support.scale_processes import ControllerUnderTest

NAMESPACE = "foreign-bench"
FOREIGN_DRIVER = "nic.example.com"
FOREIGN_NAMESPACES = 10
_GATE = DEFAULT_CONTRACT.scheduling_gate


@dataclass(frozen=True)
class ForeignConfig:
    counts: tuple[int, ...] = (0, 50_000)  # foreign claims, and as many foreign slices
    gpu_nodes: int = 4
    pods: int = 24  # gated pods placed per measurement
    creators: int = 16
    # (label, source tree whose controller/ runs; None: this tree)
    controllers: tuple[tuple[str, Path | None], ...] = (("this", None),)


@dataclass(frozen=True)
class ForeignFigures:
    controller: str
    foreign_claims: int
    foreign_slices: int
    ready_s: float
    rss_ready_mb: float
    rss_peak_mb: float
    placed: int
    decisions: int
    decision_mean_ms: float
    decision_p99_ms: float


HEADER = (
    f"{'controller':<10} {'foreign':>8} {'ready s':>8} {'RSS MB':>8} {'peak MB':>8} "
    f"{'placed':>6} {'decision ms':>11} {'p99 ms':>7}"
)


def format_row(f: ForeignFigures) -> str:
    return (
        f"{f.controller:<10} {f.foreign_claims:>8} {f.ready_s:>8.1f} {f.rss_ready_mb:>8.1f} "
        f"{f.rss_peak_mb:>8.1f} {f.placed:>6} {f.decision_mean_ms:>11.2f} "
        f"{f.decision_p99_ms:>7.2f}"
    )


# -- objects -----------------------------------------------------------------------------------


def foreign_claim(i: int) -> dict[str, Any]:
    """Another driver's claim (a NIC), as a user would have thousands of."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"nic-{i:06d}", "labels": {"app": "rdma-job", "index": str(i)}},
        "spec": {
            "devices": {
                "requests": [{"name": "nic", "exactly": {"deviceClassName": FOREIGN_DRIVER}}]
            }
        },
    }


def foreign_slice(i: int) -> dict[str, Any]:
    """Another driver's slice: four NICs of one node."""
    devices = [
        {
            "name": f"nic-{d}",
            "attributes": {
                "model": {"string": "ConnectX-7"},
                "port": {"int": d},
                "pciBusID": {"string": f"0000:{d + 0x20:02x}:00.0"},
            },
            "capacity": {"bandwidth": {"value": "400G"}},
        }
        for d in range(4)
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"nic-slice-{i:06d}"},
        "spec": {
            "driver": FOREIGN_DRIVER,
            "nodeName": f"nic-node-{i % 64:02d}",
            "pool": {"name": f"nic-pool-{i:06d}", "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _allocated_carve_claim() -> dict[str, Any]:
    template = claim_template("1g")["spec"]["spec"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "p-000001-mig-x7k2q",
            "namespace": NAMESPACE,
            "uid": "6f1a0a34-3c1e-4b8e-9d55-1c0e8a6b2f10",
            "resourceVersion": "123456",
            "finalizers": [DEFAULT_CONTRACT.allocation_finalizer],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}],
        },
        "spec": template,
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "mig",
                            "driver": DEFAULT_CONTRACT.driver,
                            "pool": "gpu-0001",
                            "device": "gpu-3-mig-1g10gb-19-2",
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["gpu-0001"]}
                            ]
                        }
                    ]
                },
                "allocationTimestamp": "2026-12-01T00:00:00Z",
            }
        },
    }


def bytes_per_object(samples: int = 200) -> dict[str, float]:
    """Bytes the controller's caches keep per object, by kind: `samples` objects parsed from
    their JSON and run through the informers' transforms, as an informer does, and only what
    is kept counted (tracemalloc: Python objects only)."""
    import json

    from controller.cache import claim_view, pod_view, slice_view
    from controller.objects import CarveClasses

    claims = claim_view(CarveClasses(), DEFAULT_CONTRACT.driver)
    pods = pod_view(_GATE, DEFAULT_CONTRACT.driver)
    slices = slice_view()
    carve_slices = node_slices(fleet_node(1), DEFAULT_CONTRACT.driver)
    gated = pod_manifest("p-000001", "1g")
    gated["spec"]["schedulingGates"] = [{"name": _GATE}]
    gated["metadata"].update(namespace=NAMESPACE, uid="u", resourceVersion="1")
    kinds: dict[str, tuple[Callable[[Any], Any], Callable[[int], Any]]] = {
        "carve claim (allocated)": (claims, lambda i: _allocated_carve_claim()),
        "foreign claim": (claims, foreign_claim),
        "carve slice (one GPU's)": (slices, lambda i: carve_slices[i % len(carve_slices)]),
        # Never sent to the controller (its slice informer's field selector).
        "foreign slice": (lambda obj: None, foreign_slice),
        "gated pod": (pods, lambda i: gated),
    }
    out: dict[str, float] = {}
    for what, (transform, make) in kinds.items():
        raw = [json.dumps(make(i)).encode() for i in range(samples)]
        kept: list[Any] = [None] * samples
        # Once, unmeasured: what the first call allocates for good (the ABCs' isinstance
        # caches, interned keys) is not kept per object.
        transform(json.loads(raw[0]))
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(samples):
            kept[i] = transform(json.loads(raw[i]))
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        out[what] = max(0.0, grown / samples)
        del kept
    return out


# -- the benchmark -----------------------------------------------------------------------------


class ForeignBench:
    """One session on one running control plane."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        config: ForeignConfig,
        progress: Callable[[str], None] = print,
    ) -> None:
        from devcluster.cluster import api_client_for
        from process.kube.jsonclient import KubeJson

        self.info = cluster_info
        self.workdir = workdir
        self.cfg = config
        self.say = progress
        self.admin = api_client_for(Path(cluster_info.kubeconfig))
        self.api = KubeJson(self.admin, request_timeout=60.0)
        self.fleet = GpuFleet(self.admin, DEFAULT_CONTRACT.driver)
        self.claims = self.slices = 0
        self._serial = 0

    def _create(self, path: str, body: dict[str, Any]) -> None:
        """Create the object; one that already exists (409) is what was wanted."""
        from process.kube.errors import ConflictError

        with contextlib.suppress(ConflictError):
            self.api.request("POST", path, body=body)

    def install(self) -> None:
        from devcluster.waiting import wait_for
        from nodesim.stack import CarveStack, gates_pod

        stack = CarveStack(Path(self.info.kubeconfig), self.workdir / "stack")
        try:
            stack.install()
        finally:
            stack.heartbeater.stop()
        namespaces = [NAMESPACE, *(f"foreign-{n}" for n in range(FOREIGN_NAMESPACES))]
        for ns in namespaces:
            self._create("/api/v1/namespaces", {"metadata": {"name": ns}})
        self._create(
            f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates",
            claim_template("1g"),
        )
        wait_for(
            "the admission policy to see the template",
            lambda: gates_pod(self.api, NAMESPACE, {"resourceClaimTemplateName": "slice-1g"}),
        )
        self.fleet.grow_to(self.cfg.gpu_nodes, self.say)
        self.fleet.start()

    def close(self) -> None:
        """Stop, and leave a control plane shared with other tests as it was found: the
        fleet's nodes, the foreign slices and the bench's namespaces (with their claims) go."""
        from process.kube.errors import ApiError

        self.fleet.stop()
        self.fleet.remove()
        namespaces = [NAMESPACE, *(f"foreign-{n}" for n in range(FOREIGN_NAMESPACES))]
        calls = [
            (
                "/apis/resource.k8s.io/v1/resourceslices",
                [("fieldSelector", f"spec.driver={FOREIGN_DRIVER}")],
            ),
            *((f"/api/v1/namespaces/{ns}", []) for ns in namespaces),
        ]
        for path, query in calls:
            try:
                self.api.request("DELETE", path, query=query)
            except ApiError:
                continue

    def grow_foreign(self, count: int) -> float:
        """Create foreign claims and slices until there are `count` of each; seconds taken."""
        begin = time.monotonic()

        def claim(i: int) -> None:
            ns = f"foreign-{i % FOREIGN_NAMESPACES}"
            self._create(
                f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims", foreign_claim(i)
            )

        def slice_(i: int) -> None:
            self._create("/apis/resource.k8s.io/v1/resourceslices", foreign_slice(i))

        jobs: list[Callable[[], None]] = [
            *(lambda i=i: claim(i) for i in range(self.claims, count)),  # type: ignore[misc]
            *(lambda i=i: slice_(i) for i in range(self.slices, count)),  # type: ignore[misc]
        ]
        with ThreadPoolExecutor(self.cfg.creators) as pool:
            for done, _ in enumerate(pool.map(lambda job: job(), jobs), 1):
                if done % 5000 == 0:
                    self.say(f"{done}/{len(jobs)} foreign objects created")
        self.claims = self.slices = max(self.claims, count)
        return time.monotonic() - begin

    def measure(self, label: str, source: Path | None) -> ForeignFigures:
        from devcluster.waiting import wait_for

        self._serial += 1
        log = self.workdir / f"controller-{label}-{self.claims}-{self._serial}.log"
        controller = ControllerUnderTest(Path(self.info.kubeconfig), log, source)
        try:
            wait_for("the controller to be ready", controller.ready, timeout=900)
            ready_s = time.monotonic() - controller.started
            rss_ready = controller.rss_mb()
            before = promtext.buckets(controller.metrics(), "carve_decision_seconds")
            names = [f"p-{self._serial:02d}-{i:04d}" for i in range(self.cfg.pods)]
            for name in names:
                body = pod_manifest(name, "1g")
                body["spec"]["schedulingGates"] = [{"name": _GATE}]
                self._create(f"/api/v1/namespaces/{NAMESPACE}/pods", body)
            placed = wait_for(
                f"{len(names)} pods placed",
                lambda: self._placed(names) if self._placed(names) == len(names) else None,
                timeout=300,
            )
            text = controller.metrics()
            after = promtext.buckets(text, "carve_decision_seconds")
            count = promtext.counter_sum(text, "carve_decision_seconds_count")
            total = promtext.counter_sum(text, "carve_decision_seconds_sum")
            return ForeignFigures(
                controller=label,
                foreign_claims=self.claims,
                foreign_slices=self.slices,
                ready_s=ready_s,
                rss_ready_mb=rss_ready,
                rss_peak_mb=_peak_mb(controller.process.pid),
                placed=placed,
                decisions=int(count),
                decision_mean_ms=1000 * total / count if count else math.nan,
                decision_p99_ms=1000 * promtext.quantile(before, after, 0.99),
            )
        finally:
            controller.stop()
            self._clear_pods()

    def _placed(self, names: list[str]) -> int:
        pods = self.api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        return sum(
            1
            for p in pods
            if p["metadata"]["name"] in names
            and not any(g.get("name") == _GATE for g in p["spec"].get("schedulingGates") or [])
        )

    def _clear_pods(self) -> None:
        """Delete the batch and wait until its claims are gone (no kubelet runs the pods, so
        nothing holds a node finalizer; a controller still running releases them; otherwise
        the next one does, and the claims are deleted then)."""
        from devcluster.waiting import wait_for

        self.api.request(
            "DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods", query=[("gracePeriodSeconds", "0")]
        )
        wait_for(
            "the batch's pods to be gone",
            lambda: not self.api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"],
            timeout=120,
        )

    def run(self) -> Iterator[ForeignFigures]:
        for count in self.cfg.counts:
            took = self.grow_foreign(count)
            self.say(f"{self.claims} foreign claims and {self.slices} slices ({took:.0f}s)")
            for label, source in self.cfg.controllers:
                yield self.measure(label, source)


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan
