"""Fake GPU nodes for the scale benchmark: Node objects, their Leases and exactly the
ResourceSlices carve's kubelet plugin would publish, with no plugin or kubelet process.

Liveness: kube-controller-manager runs its node-lifecycle controller as in any cluster. That
controller counts a renewed Lease in kube-node-lease as a heartbeat (as it does for a real
kubelet, which posts its node status only when it changes or every five minutes), so the fleet
renews Leases only and never patches Node status: the Node objects stay unchanged for the whole
run, as they would on an idle real cluster.

Each node is homogeneous (eight GPUs of one catalogue model), the models rotate across nodes so
the controller's model holds several GPU kinds, as a mixed real fleet would.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from devcluster.nodes import (
    NODE_LEASE_NAMESPACE,
    NOT_READY_TAINT,
    FakeNode,
    heartbeat_patch,
    lease_manifest,
    node_manifest,
    node_status,
)
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices
from process.kube.errors import ApiError
from process.kube.jsonclient import KubeJson

# Models a MIG fleet mixes; per-node homogeneous, rotating across nodes.
FLEET_MODELS = ("A100-SXM4-80GB", "H100-SXM5-80GB", "H200-SXM5-141GB", "A30-24GB")
FLEET_LABEL = "bench.carve.dev/gpu-fleet"
LEASE_RENEW_SECONDS = 10.0  # the kubelet's default; the lease lasts 40 s
READY_CHECK_ROUNDS = 3  # every third renewal round, post Ready again where it was lost
_MERGE = "application/merge-patch+json"
_STRATEGIC = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class FleetNode:
    index: int  # unique in the fleet: the GPUs' UUIDs are derived from it
    name: str
    model_key: str
    gpus: int | None = None  # None: the fleet's gpus_per_node
    cpu: str = FakeNode.cpu  # what the node reports (capacity = allocatable)
    memory: str = FakeNode.memory
    labels: tuple[tuple[str, str], ...] = ()  # beside FLEET_LABEL


def fleet_node(index: int) -> FleetNode:
    return FleetNode(index, f"gpu-{index:04d}", FLEET_MODELS[index % len(FLEET_MODELS)])


def node_slices(node: FleetNode, driver: str, gpus_per_node: int = 8) -> list[dict[str, Any]]:
    """The pool the plugin publishes for this node (counter slices split out, as on 1.35+)."""
    model = gpu_model(node.model_key)
    if node.gpus is not None:
        gpus_per_node = node.gpus
    gpus = [
        PublishedGpu(
            minor=i,
            uuid=f"GPU-{node.index:08x}-{i:04x}-4000-8000-{node.index:08x}{i:04x}",
            model=model,
            pci_bus_id=f"0000:{0x10 + i:02x}:00.0",
            driver_version="580.105.08",
        )
        for i in range(gpus_per_node)
    ]
    return build_resource_slices(
        driver=driver, node_name=node.name, pool_generation=1, gpus=gpus, split_counters=True
    )


def plain_pod(name: str, node: str) -> dict[str, Any]:
    """A pod of some other workload, already bound to `node` (created with spec.nodeName)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "other-workload"}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "app",
                    "image": "registry.invalid/other:never-pulled",
                    "env": [{"name": "MODE", "value": "serve"}],
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                }
            ],
        },
    }


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class GpuFleet:
    """Creates fake GPU nodes in parallel and keeps their Leases renewed."""

    def __init__(
        self,
        api_client: Any,
        driver: str,
        *,
        gpus_per_node: int = 8,
        workers: int = 8,
        renew_seconds: float = LEASE_RENEW_SECONDS,
        plain_pods_per_node: int = 0,
        plain_namespace: str = "plain",
    ) -> None:
        """`plain_pods_per_node` pods that are not carve's (no claims) are bound to each node,
        as the other workloads of a real cluster are; no kubelet runs them."""
        self._api = KubeJson(api_client, request_timeout=60.0)
        self._driver = driver
        self._gpus = gpus_per_node
        self._workers = workers
        self._renew_seconds = renew_seconds
        self.nodes: dict[str, str] = {}  # name -> uid
        self.slices = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renew_failures = 0
        self.ready_again = 0  # nodes whose Ready was posted again after node-lifecycle lost them
        self._plain = plain_pods_per_node
        self._plain_ns = plain_namespace
        self.plain_pods = 0
        self._gpu_count = 0

    @property
    def gpu_count(self) -> int:
        return self._gpu_count

    def grow_to(self, count: int, progress: Callable[[str], None] = lambda _m: None) -> float:
        """Add nodes until the fleet has `count`; returns the seconds it took (all Ready)."""
        return self.add([fleet_node(i) for i in range(len(self.nodes), count)], progress)

    def add(
        self, todo: Sequence[FleetNode], progress: Callable[[str], None] = lambda _m: None
    ) -> float:
        """Add these nodes (each as it says: model, GPU count, cpu, memory); returns the
        seconds it took (all Ready)."""
        begin = time.monotonic()
        with ThreadPoolExecutor(self._workers) as pool:
            for done, _ in enumerate(pool.map(self._add, todo), 1):
                if done % 100 == 0:
                    progress(f"{len(self.nodes)} nodes created")
        self._wait_untainted([n.name for n in todo])
        return time.monotonic() - begin

    def _add(self, node: FleetNode) -> None:
        fake = FakeNode(
            name=node.name,
            cpu=node.cpu,
            memory=node.memory,
            labels={FLEET_LABEL: node.model_key, **dict(node.labels)},
        )
        created = self._api.request("POST", "/api/v1/nodes", body=node_manifest(fake))
        uid = str(created["metadata"]["uid"])
        now = _now()
        self._api.request(
            "PATCH",
            f"/api/v1/nodes/{node.name}/status",
            body=node_status(fake, now),
            content_type=_STRATEGIC,
        )
        self._api.request(
            "POST",
            f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases",
            body=lease_manifest(node.name, uid, now),
        )
        for manifest in node_slices(node, self._driver, self._gpus):
            self._api.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body=manifest)
            with self._lock:
                self.slices += 1
        for i in range(self._plain):
            self._api.request(
                "POST",
                f"/api/v1/namespaces/{self._plain_ns}/pods",
                body=plain_pod(f"{node.name}-{i}", node.name),
            )
        with self._lock:
            self.nodes[node.name] = uid
            self.plain_pods += self._plain
            self._gpu_count += self._gpus if node.gpus is None else node.gpus

    def _wait_untainted(self, names: Sequence[str], timeout: float = 300.0) -> None:
        """Admission gives every new Node the not-ready taint; node-lifecycle lifts it once it
        sees the Ready condition (it looks every 5 s)."""
        wanted = set(names)
        deadline = time.monotonic() + timeout
        while wanted:
            page = self._api.request("GET", "/api/v1/nodes", query=[("labelSelector", FLEET_LABEL)])
            for item in page.get("items") or []:
                taints = (item.get("spec") or {}).get("taints") or []
                if not any(t.get("key") == NOT_READY_TAINT for t in taints):
                    wanted.discard(item["metadata"]["name"])
            if not wanted:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(wanted)} fleet nodes still carry {NOT_READY_TAINT}")
            time.sleep(1.0)

    # -- liveness ------------------------------------------------------------------------------

    def start(self) -> GpuFleet:
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_loop, daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def remove(self) -> None:
        """Delete the fleet's Nodes with their ResourceSlices and Leases (after `stop`), so a
        control plane shared with other tests is left without them."""

        def remove_one(name: str) -> None:
            for method, path, query in (
                (
                    "DELETE",
                    "/apis/resource.k8s.io/v1/resourceslices",
                    [("fieldSelector", f"spec.nodeName={name}")],
                ),
                (
                    "DELETE",
                    f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{name}",
                    [],
                ),
                ("DELETE", f"/api/v1/nodes/{name}", []),
            ):
                try:
                    self._api.request(method, path, query=query)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
            with self._lock:
                self.nodes.pop(name, None)

        with ThreadPoolExecutor(self._workers) as pool:
            list(pool.map(remove_one, list(self.nodes)))

    def _renew_loop(self) -> None:
        rounds = 0
        with ThreadPoolExecutor(4) as pool:
            while not self._stop.wait(self._renew_seconds):
                with self._lock:
                    names = list(self.nodes)
                list(pool.map(self._renew, names))
                rounds += 1
                if rounds % READY_CHECK_ROUNDS == 0:
                    self._post_ready_again()

    def _post_ready_again(self) -> None:
        """Post Ready again for fleet nodes node-lifecycle marked unknown.

        When the machine is so loaded that Lease renewals miss the grace period,
        node-lifecycle sets Ready to Unknown and taints the node. It never sets Ready back:
        a kubelet does, by posting its status once it reaches the apiserver again. Without
        this, one starved minute would take the fleet out for the rest of a run."""
        try:
            page = self._api.request("GET", "/api/v1/nodes", query=[("labelSelector", FLEET_LABEL)])
        except (ApiError, OSError):
            return
        for item in page.get("items") or []:
            conditions = (item.get("status") or {}).get("conditions") or []
            ready = next((c for c in conditions if c.get("type") == "Ready"), {})
            if ready.get("status") == "True":
                continue
            name = item["metadata"]["name"]
            if name not in self.nodes:  # another fleet's, on a shared control plane
                continue
            try:
                self._api.request(
                    "PATCH",
                    f"/api/v1/nodes/{name}/status",
                    body=heartbeat_patch(_now()),
                    content_type=_STRATEGIC,
                )
            except (ApiError, OSError):
                continue
            with self._lock:
                self.ready_again += 1

    def _renew(self, name: str) -> None:
        stamp = _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            self._api.request(
                "PATCH",
                f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/{name}",
                body={"spec": {"renewTime": stamp}},
                content_type=_MERGE,
            )
        except (ApiError, OSError):
            with self._lock:
                self.renew_failures += 1
