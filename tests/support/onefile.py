"""The one-file-apply benchmark's machinery (`python -m bench.one_file_apply` is the command
line): a ResourceClaimTemplate and the pod that uses it in one file, `kubectl apply`-ed as
every published example is written, many times, while other clients churn templates (the
admission gate reads templates from the apiserver's cache, and a busy cache is when a pod can
get there first). Counted (issue 30.4): how many pods admission gated, how many escaped the gate,
and how many of their claims carve allocated (its finalizer on the claim) or kube-scheduler did.

It lives here so that tests/bench/test_one_file_apply.py runs it at a small count (tests never
import bench/)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from driver.contract import DEFAULT_CONTRACT
from tests.support.gpufleet import GpuFleet
from tests.support.scale_processes import ControllerUnderTest

NAMESPACE = "one-file"
CHURN_NAMESPACE = "one-file-churn"
_CLAIM_PROFILE = f'device.attributes["{DEFAULT_CONTRACT.driver}"].profile.startsWith("1g.")'


@dataclass(frozen=True)
class OneFileConfig:
    applies: int = 100
    gpu_nodes: int = 4  # 8 GPUs each: room for every pod's 1g slice at once
    churners: int = 4  # threads creating and deleting templates meanwhile (the load)
    sole_allocator: bool = True  # install deploy/manifests/31-sole-allocator.yaml
    source: Path | None = None  # another tree's controller (e.g. a worktree of main)


@dataclass(frozen=True)
class OneFileFigures:
    applies: int
    gated: int  # the pod had carve's gate when the apiserver admitted it
    escaped: int  # it did not (carve said PlacingUngated, or kube-scheduler allocated it)
    placed_by_carve: int  # its claim carries carve's finalizer (only carve adds it)
    placed_by_scheduler: int  # allocated, without carve's finalizer
    unallocated: int
    churned_templates: int
    seconds: float

    def row(self) -> str:
        return (
            f"{self.applies} one-file applies: {self.gated} gated at admission, "
            f"{self.escaped} escaped the gate; carve placed {self.placed_by_carve}, "
            f"kube-scheduler {self.placed_by_scheduler}, unallocated {self.unallocated} "
            f"({self.churned_templates} templates churned meanwhile, {self.seconds:.0f}s)"
        )


def one_file(i: int) -> str:
    """A template and its pod, in one file, template first (kubectl applies in file order)."""
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"slice-{i:04d}", "namespace": NAMESPACE},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "mig",
                            "exactly": {
                                "deviceClassName": DEFAULT_CONTRACT.mig_class,
                                "selectors": [{"cel": {"expression": _CLAIM_PROFILE}}],
                            },
                        }
                    ]
                }
            }
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"job-{i:04d}", "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": f"slice-{i:04d}"}],
            "containers": [
                {
                    "name": "work",
                    "image": "registry.invalid/bench:never-pulled",
                    "resources": {"claims": [{"name": "mig"}]},
                }
            ],
        },
    }
    return yaml.safe_dump_all([template, pod], sort_keys=False)


class OneFileBench:
    """One session on one running control plane."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        config: OneFileConfig,
        progress: Callable[[str], None],
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
        self._stop = threading.Event()
        self._churn_lock = threading.Lock()
        self.churned = 0

    def _post(self, path: str, body: dict[str, Any]) -> None:
        """Create the object; one that already exists (409) is what was wanted."""
        from process.kube.errors import ConflictError

        with contextlib.suppress(ConflictError):
            self.api.request("POST", path, body=body)

    def install(self) -> None:
        from nodesim.stack import INSTALL_MANIFESTS, CarveStack

        manifests = [
            m for m in INSTALL_MANIFESTS if self.cfg.sole_allocator or "sole-allocator" not in m
        ]
        stack = CarveStack(Path(self.info.kubeconfig), self.workdir / "stack")
        try:
            stack.install(manifests)
        finally:
            stack.heartbeater.stop()
        for ns in (NAMESPACE, CHURN_NAMESPACE):
            self._post("/api/v1/namespaces", {"metadata": {"name": ns}})
        self.fleet.grow_to(self.cfg.gpu_nodes, self.say)
        self.fleet.start()

    def close(self) -> None:
        """Stop, and leave a control plane shared with other tests as it was found: the
        fleet's nodes and slices and the bench's namespaces go."""
        from process.kube.errors import ApiError

        self._stop.set()
        self.fleet.stop()
        self.fleet.remove()
        for ns in (NAMESPACE, CHURN_NAMESPACE):
            try:
                self.api.request("DELETE", f"/api/v1/namespaces/{ns}")
            except ApiError:
                continue

    def _churn(self, worker: int) -> None:
        """Templates created and deleted as fast as the apiserver takes them: the policy's
        parameter cache is busy, as in a cluster where many jobs start."""
        from process.kube.errors import ApiError

        path = f"/apis/resource.k8s.io/v1/namespaces/{CHURN_NAMESPACE}/resourceclaimtemplates"
        n = 0
        while not self._stop.is_set():
            n += 1
            name = f"churn-{worker}-{n}"
            body = yaml.safe_load(one_file(n).split("---")[0])
            body["metadata"] = {"name": name}
            try:
                self.api.request("POST", path, body=body)
                self.api.request("DELETE", f"{path}/{name}")
                with self._churn_lock:
                    self.churned += 1
            except ApiError:
                continue

    def run(self) -> OneFileFigures:
        from devcluster.cluster import run_kubectl
        from devcluster.waiting import wait_for

        controller = ControllerUnderTest(
            Path(self.info.kubeconfig), self.workdir / "controller.log", self.cfg.source
        )
        churners = ThreadPoolExecutor(self.cfg.churners)
        try:
            wait_for("the controller to be ready", controller.ready, timeout=300)
            for w in range(self.cfg.churners):
                churners.submit(self._churn, w)
            begin = time.monotonic()
            for i in range(self.cfg.applies):
                path = self.workdir / f"job-{i:04d}.yaml"
                path.write_text(one_file(i))
                run_kubectl(Path(self.info.kubeconfig), "apply", "-f", str(path))
                if (i + 1) % 20 == 0:
                    self.say(f"{i + 1} applies")
            self._stop.set()
            wait_for(
                "every applied pod's claim to be allocated",
                lambda: self._count()["unallocated"] == 0,
                timeout=300,
            )
            counts = self._count()
            return OneFileFigures(
                applies=self.cfg.applies,
                gated=self.cfg.applies - counts["escaped"],
                escaped=counts["escaped"],
                placed_by_carve=counts["carve"],
                placed_by_scheduler=counts["scheduler"],
                unallocated=counts["unallocated"],
                churned_templates=self.churned,
                seconds=time.monotonic() - begin,
            )
        finally:
            self._stop.set()
            churners.shutdown(wait=True)
            controller.stop()

    def _count(self) -> dict[str, int]:
        pods = self.api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        claims = self.api.request(
            "GET", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        )["items"]
        events = self.api.request("GET", f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events")
        # carve tells a pod that reached kube-scheduler without its gate (`PlacingUngated`);
        # a controller without that (main) leaves such a pod to kube-scheduler instead.
        ungated = {
            e["regarding"]["name"] for e in events["items"] if e.get("reason") == "PlacingUngated"
        }
        out = {"escaped": len(ungated), "carve": 0, "scheduler": 0, "unallocated": 0}
        by_name = {c["metadata"]["name"]: c for c in claims}
        for pod in pods:
            statuses = (pod.get("status") or {}).get("resourceClaimStatuses") or []
            claim = by_name.get(statuses[0].get("resourceClaimName", "")) if statuses else None
            if claim is None or not (claim.get("status") or {}).get("allocation"):
                out["unallocated"] += 1
            elif DEFAULT_CONTRACT.allocation_finalizer in (
                claim["metadata"].get("finalizers") or []
            ):
                out["carve"] += 1
            else:
                out["scheduler"] += 1
                out["escaped"] += 1  # only an ungated pod's claim reaches kube-scheduler
        return out
