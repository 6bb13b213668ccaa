"""The namespace-flood benchmark's machinery (`python -m bench.flood` is the command line): one
namespace with no quota creates tens of thousands of pods that wait, then another namespace
creates a hundred that fit (issue 41.5). carve must neither run out of memory nor make the
second namespace wait behind the first.

One run per controller (this tree's, and optionally another source tree's, e.g. a `git
worktree` of main), each on a fresh private control plane (so each starts from an empty etcd):
- a small fake GPU fleet (`tests.support.gpufleet`, 8 GPUs a node), half its nodes labelled
  pool=batch and half pool=interactive;
- `--pods` pods in namespace `flood`, each as a real training job's pod is written (env,
  volumes, probes, labels; ~5 KB of JSON), carrying the gate itself (`GATED_LABEL` says why)
  and asking for one 1g slice on a batch node: the first fill the batch nodes, the rest wait;
- then `tenant_pods` pods in namespace `tenant` asking for one 1g slice on an interactive node
  (there is room for all of them), created one after another; each is timed from its creation
  (the POST's answer) to its placement (carve's gate gone, seen by a watch).
Printed: the controller's resident memory at the end and at its peak (VmHWM), the tenant's p50
and p99, and what the controller shed (`carve_shed_pods`), in the one line the issue asks for.

It lives here so that tests/bench/test_flood.py runs it at a small count (tests never import
bench/)."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from driver.contract import DEFAULT_CONTRACT
from tests.support import promtext
from tests.support.gpufleet import GpuFleet, fleet_node
from tests.support.scale_pods import PodTracker, claim_template, pod_manifest
from tests.support.scale_processes import ControllerUnderTest

FLOOD = "flood"
TENANT = "tenant"
POOL_LABEL = "bench.carve.dev/pool"
GATED_LABEL = "bench.carve.dev/gated"
"""Only the tenant's namespace is matched by carve's mutating admission policies; the flood's
pods carry the gate themselves. The policy that gates pods naming a ResourceClaim takes every
claim of the pod's namespace as a parameter, so each pod created in a namespace of N claims is
checked N times: in the flood namespace creation slowed to ~2.5 pods/s at 3,000 claims on
this machine, and the flood could not be built at all."""
_GATE = DEFAULT_CONTRACT.scheduling_gate


@dataclass(frozen=True)
class FloodConfig:
    pods: int = 50_000  # in the flooding namespace
    tenant_pods: int = 100
    gpu_nodes: int = 6  # half batch, half interactive (at least one of each): 144 1g slices
    creators: int = 16
    placed_timeout_s: float = 600.0  # a tenant pod not placed by then counts as this long
    # (label, source tree whose controller/ runs; None: this tree)
    controllers: tuple[tuple[str, Path | None], ...] = (("this", None),)
    extra: tuple[str, ...] = ()  # more controller flags
    # Whether carve's mutating admission policies see the flood's namespace (`GATED_LABEL`
    # says why the bench says no); a control plane shared with other tests keeps them whole.
    admit_flood: bool = True


@dataclass(frozen=True)
class FloodFigures:
    controller: str
    pods: int
    created_s: float  # to create the flood
    rss_mb: float  # at the end
    peak_mb: float  # VmHWM
    tenant_placed: int
    tenant_p50_s: float
    tenant_p99_s: float
    shed: int

    def line(self) -> str:
        return (
            f"pods={self.pods} controller_rss_mb={self.rss_mb:.0f} "
            f"other_namespace_p99_s={self.tenant_p99_s:.2f} shed={self.shed}"
        )

    def describe(self) -> str:
        return (
            f"{self.controller}: flood of {self.pods} created in {self.created_s:.0f}s; "
            f"RSS {self.rss_mb:.0f} MB (peak {self.peak_mb:.0f} MB); tenant placed "
            f"{self.tenant_placed}, p50 {self.tenant_p50_s:.2f}s p99 {self.tenant_p99_s:.2f}s; "
            f"shed {self.shed}"
        )


# -- objects -----------------------------------------------------------------------------------


def job_pod(name: str, pool: str, index: int) -> dict[str, Any]:
    """A pod as a training job's controller writes it: one carve claim (a 1g slice), a node
    selector, and the env, mounts, probes and labels real pods carry (what makes a pod some
    13 KB once parsed, and what carve need not keep)."""
    pod = pod_manifest(name, "1g")
    meta, spec = pod["metadata"], pod["spec"]
    meta["labels"] = {
        "app.kubernetes.io/name": "trainer",
        "app.kubernetes.io/instance": f"run-{index // 100:05d}",
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/managed-by": "job-operator",
        "batch.kubernetes.io/job-name": f"train-{index // 100:05d}",
        "team": "research",
        "experiment": f"exp-{index % 37:03d}",
        "worker-index": str(index % 100),
    }
    meta["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9400",
        "checksum/config": f"{index:064x}",
        "job-operator.example.com/spec": '{"replicas":100,"backoffLimit":6,"ttl":86400}' * 3,
    }
    spec["schedulingGates"] = [{"name": _GATE}]
    spec["nodeSelector"] = {POOL_LABEL: pool}
    container = spec["containers"][0]
    container.update(
        command=["python", "-m", "trainer.main"],
        args=["--config=/etc/trainer/config.yaml", f"--seed={index}", "--checkpoint=/ckpt"],
        env=[
            *(
                {"name": f"TRAINER_SETTING_{i:02d}", "value": f"value-{i}-{index}"}
                for i in range(24)
            ),
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        ports=[
            {"name": "metrics", "containerPort": 9400},
            {"name": "nccl", "containerPort": 29500},
        ],
        volumeMounts=[
            {"name": "config", "mountPath": "/etc/trainer", "readOnly": True},
            {"name": "data", "mountPath": "/data", "readOnly": True},
            {"name": "ckpt", "mountPath": "/ckpt"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
        readinessProbe={"httpGet": {"path": "/ready", "port": 9400}, "periodSeconds": 10},
        livenessProbe={"httpGet": {"path": "/live", "port": 9400}, "failureThreshold": 6},
        securityContext={
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "allowPrivilegeEscalation": False,
        },
    )
    spec["volumes"] = [
        {"name": "config", "configMap": {"name": f"train-{index // 100:05d}-config"}},
        {"name": "data", "configMap": {"name": "datasets-index", "optional": True}},
        {"name": "ckpt", "emptyDir": {"sizeLimit": "20Gi"}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ]
    spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return pod


# -- the benchmark -----------------------------------------------------------------------------


class FloodRun:
    """One controller's run on one fresh control plane (`cluster_info`)."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        config: FloodConfig,
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

    def _create(self, path: str, body: dict[str, Any]) -> None:
        from process.kube.errors import ConflictError

        with contextlib.suppress(ConflictError):
            self.api.request("POST", path, body=body)

    def install(self) -> None:
        from devcluster.waiting import wait_for
        from nodesim.stack import CarveStack, gates_pod

        stack = CarveStack(Path(self.info.kubeconfig), self.workdir / "stack")
        try:
            stack.install(gate_namespaces=None if self.cfg.admit_flood else {GATED_LABEL: "true"})
        finally:
            stack.heartbeater.stop()
        for ns in (FLOOD, TENANT):
            labels = {GATED_LABEL: "true"} if ns == TENANT else {}
            self._create("/api/v1/namespaces", {"metadata": {"name": ns, "labels": labels}})
            self._create(
                f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates",
                claim_template("1g"),
            )
        wait_for(
            "the admission policy to see the tenant's template",
            lambda: gates_pod(self.api, TENANT, {"resourceClaimTemplateName": "slice-1g"}),
        )
        half = max(1, self.cfg.gpu_nodes // 2)
        nodes = [
            replace(fleet_node(i), labels=((POOL_LABEL, "batch" if i < half else "interactive"),))
            for i in range(max(2, self.cfg.gpu_nodes))
        ]
        self.fleet.add(nodes, self.say)
        self.fleet.start()

    def close(self) -> None:
        """Stop, and leave a control plane shared with other tests as it was found."""
        from process.kube.errors import ApiError

        self.fleet.stop()
        self.fleet.remove()
        for ns in (FLOOD, TENANT):
            with contextlib.suppress(ApiError):
                self.api.request("DELETE", f"/api/v1/namespaces/{ns}")

    def flood_placed(self) -> int:
        """Flood pods placed (carve's gate gone); a list of the namespace, for small floods."""
        pods = self.api.request("GET", f"/api/v1/namespaces/{FLOOD}/pods")["items"]
        return sum(
            1
            for p in pods
            if not any(g.get("name") == _GATE for g in p["spec"].get("schedulingGates") or [])
        )

    def _flood(self) -> float:
        begin = time.monotonic()
        path = f"/api/v1/namespaces/{FLOOD}/pods"

        def create(i: int) -> None:
            self._create(path, job_pod(f"train-{i:06d}", "batch", i))

        with ThreadPoolExecutor(self.cfg.creators) as pool:
            for done, _ in enumerate(pool.map(create, range(self.cfg.pods)), 1):
                if done % 5000 == 0:
                    self.say(f"{done}/{self.cfg.pods} flood pods created")
        return time.monotonic() - begin

    def _claims_made(self) -> bool:
        page = self.api.request(
            "GET",
            f"/apis/resource.k8s.io/v1/namespaces/{FLOOD}/resourceclaims",
            query=[("limit", "1")],
        )
        count = len(page.get("items") or []) + int(page["metadata"].get("remainingItemCount") or 0)
        return count >= self.cfg.pods

    def _watched(self) -> tuple[PodTracker, Any]:
        from controller.informers import Informer, InformerConfig
        from controller.objects import Kind
        from process.kube.listwatch import JsonCollection

        tracker = PodTracker()
        watcher = Informer(
            Kind.POD,
            JsonCollection(self.api, f"/api/v1/namespaces/{TENANT}/pods"),
            tracker.on_pod,
            lambda _k: None,
            InformerConfig(watch_timeout_s=120, resync_period_s=3600.0),
        )
        threading.Thread(target=watcher.run, args=(time.monotonic,), daemon=True).start()
        while not watcher.has_synced:
            time.sleep(0.05)
        return tracker, watcher

    def _tenant(self, tracker: PodTracker) -> list[float]:
        """Create the tenant's pods one after another; each one's seconds to placement."""
        path = f"/api/v1/namespaces/{TENANT}/pods"
        names = [f"svc-{i:04d}" for i in range(self.cfg.tenant_pods)]
        for i, name in enumerate(names):
            self.api.request("POST", path, body=job_pod(name, "interactive", i))
            tracker.created(name, time.monotonic())
        deadline = time.monotonic() + self.cfg.placed_timeout_s
        while time.monotonic() < deadline:
            times = tracker.snapshot()
            if all(not math.isnan(times[n].placed) for n in names if n in times):
                break
            time.sleep(0.5)
        times = tracker.snapshot()
        return [
            (t.placed - t.created) if not math.isnan(t.placed) else self.cfg.placed_timeout_s
            for t in (times[n] for n in names)
        ]

    def run(
        self, label: str, source: Path | None, *, keep: bool = False
    ) -> tuple[FloodFigures, ControllerUnderTest | None]:
        """The run's figures; with `keep`, the controller too, still running (else stopped)."""
        from devcluster.waiting import wait_for

        controller = ControllerUnderTest(
            Path(self.info.kubeconfig), self.workdir / f"controller-{label}.log", source,
            extra=self.cfg.extra,
        )  # fmt: skip
        try:
            wait_for("the controller to be ready", controller.ready, timeout=300)
            created_s = self._flood()
            self.say(f"{label}: {self.cfg.pods} flood pods created in {created_s:.0f}s")
            # kube-controller-manager makes the flood's claims in the order the pods came: a
            # tenant pod created before it caught up would time kube-controller-manager.
            wait_for("the flood's claims", self._claims_made, timeout=3600)
            tracker, watcher = self._watched()
            try:
                waits = sorted(self._tenant(tracker))
            finally:
                watcher.stop()
            text = controller.metrics() if controller.alive() else ""
            placed = sum(1 for w in waits if w < self.cfg.placed_timeout_s)
            figures = FloodFigures(
                controller=label,
                pods=self.cfg.pods,
                created_s=created_s,
                rss_mb=controller.rss_mb() if controller.alive() else math.nan,
                peak_mb=_peak_mb(controller.process.pid) if controller.alive() else math.nan,
                tenant_placed=placed,
                tenant_p50_s=_quantile(waits, 0.50),
                tenant_p99_s=_quantile(waits, 0.99),
                shed=int(promtext.counter_sum(text, "carve_shed_pods")) if text else 0,
            )
        except BaseException:
            controller.stop()
            raise
        if keep:
            return figures, controller
        controller.stop()
        return figures, None


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan
