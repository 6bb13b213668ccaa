"""Fake Node objects that kube-scheduler accepts and kube-controller-manager leaves alone.

There is no kubelet, so something must do a kubelet's bookkeeping: post the node status
(capacity, allocatable, Ready) and renew the node's Lease in kube-node-lease. Without it the
node-lifecycle controller marks the node unreachable after the grace period (50 s), taints
it NoSchedule/NoExecute, and the taint-eviction controller deletes its pods.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

NODE_LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40
HEARTBEAT_SECONDS = 10.0
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# Every fake node carries this label, so a heartbeat process can find nodes that other
# tools created (the demo, a shell) without being told their names.
FAKE_NODE_LABEL = "devcluster.carve.dev/fake-node"
_STRATEGIC_MERGE = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str  # NoSchedule | PreferNoSchedule | NoExecute
    value: str = ""


@dataclass(frozen=True)
class FakeNode:
    """What a kubelet would report for one node. ``extra_resources`` adds extended
    resources (e.g. ``{"example.com/foo": "2"}``) to capacity and allocatable."""

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    extra_resources: Mapping[str, str] = field(default_factory=dict)


def node_manifest(node: FakeNode) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        FAKE_NODE_LABEL: "true",
        **node.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": labels},
        "spec": {
            "taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in node.taints]
        },
    }


def node_status(node: FakeNode, now: datetime.datetime) -> dict[str, Any]:
    resources = {"cpu": node.cpu, "memory": node.memory, "pods": node.pods, **node.extra_resources}
    stamp = _time(now)
    return {
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                _condition(
                    "Ready", "True", "KubeletReady", "fake kubelet is posting status", stamp
                ),
                _condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "", stamp),
                _condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "", stamp),
                _condition("PIDPressure", "False", "KubeletHasSufficientPID", "", stamp),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": node.name},
            ],
            "nodeInfo": {
                "machineID": node.name,
                "systemUUID": node.name,
                "bootID": node.name,
                "kernelVersion": "devcluster",
                "osImage": "devcluster",
                "containerRuntimeVersion": "none://0",
                "kubeletVersion": "v1.37.2",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
    }


def heartbeat_patch(now: datetime.datetime) -> dict[str, Any]:
    """Strategic merge patch (conditions merge on ``type``) refreshing only Ready."""
    stamp = _time(now)
    return {
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": stamp}]}
    }


def lease_manifest(node_name: str, node_uid: str, now: datetime.datetime) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node_name,
            "namespace": NODE_LEASE_NAMESPACE,
            # As the kubelet does: deleting the Node garbage-collects its Lease.
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid}
            ],
        },
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": _micro_time(now),
        },
    }


def create_node(api: ApiClient, node: FakeNode) -> str:
    """Create the Node, post its status and its Lease; returns the node's UID."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    created = core.create_node(client.V1Node.model_validate(node_manifest(node)))
    assert created.metadata is not None
    uid = str(created.metadata.uid)
    now = _utcnow()
    core.patch_node_status(node.name, node_status(node, now), _content_type=_STRATEGIC_MERGE)
    _renew_lease(api, node.name, uid, now)
    _wait_until_ready_for_scheduling(core, node.name)
    return uid


def _wait_until_ready_for_scheduling(core: Any, name: str, timeout: float = 30.0) -> None:
    """The TaintNodesByCondition admission plugin gives every new Node the not-ready
    NoSchedule taint; node-lifecycle-controller lifts it once it sees Ready=True. Returning
    earlier would let the scheduler reject pods for "untolerated taint(s)"."""
    deadline = time.monotonic() + timeout
    while True:
        taints = core.read_node(name).spec.taints or []
        if not any(t.key == NOT_READY_TAINT for t in taints):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"node {name} still has the {NOT_READY_TAINT} taint after {timeout:.0f}s; "
                "is kube-controller-manager's node-lifecycle-controller running?"
            )
        time.sleep(0.1)


def delete_node(api: ApiClient, name: str) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        client.CoreV1Api(api).delete_node(name)
    except ApiException as exc:
        if exc.status != 404:
            raise


class NodeHeartbeater:
    """Background thread that keeps nodes' Ready condition and Lease fresh.

    A node whose heartbeat fails (e.g. it was deleted) is dropped, not retried forever."""

    def __init__(
        self, api: ApiClient, interval: float = HEARTBEAT_SECONDS, *, discover: bool = False
    ) -> None:
        """With ``discover``, every beat also adopts all nodes labelled FAKE_NODE_LABEL."""
        self._api = api
        self._interval = interval
        self._discover = discover
        self._nodes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, node: FakeNode) -> str:
        """Create ``node`` and keep it alive; returns its UID."""
        uid = create_node(self._api, node)
        with self._lock:
            self._nodes[node.name] = uid
        return uid

    def adopt(self, name: str, uid: str) -> None:
        with self._lock:
            self._nodes[name] = uid

    def forget(self, name: str) -> None:
        with self._lock:
            self._nodes.pop(name, None)

    def start(self) -> NodeHeartbeater:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="devcluster-node-heartbeat", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 5)
            self._thread = None

    def beat_once(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self._api)
        if self._discover:
            for found in core.list_node(label_selector=f"{FAKE_NODE_LABEL}=true").items:
                if found.metadata is not None and found.metadata.name:
                    self.adopt(found.metadata.name, str(found.metadata.uid))
        with self._lock:
            nodes = dict(self._nodes)
        for name, uid in nodes.items():
            now = _utcnow()
            try:
                core.patch_node_status(name, heartbeat_patch(now), _content_type=_STRATEGIC_MERGE)
                _renew_lease(self._api, name, uid, now)
            except ApiException as exc:
                if exc.status == 404:
                    self.forget(name)
                    continue
                raise

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with contextlib.suppress(Exception):  # a transient API error must not end beats
                self.beat_once()


def _renew_lease(api: ApiClient, name: str, uid: str, now: datetime.datetime) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    coordination = client.CoordinationV1Api(api)
    manifest = lease_manifest(name, uid, now)
    try:
        coordination.patch_namespaced_lease(
            name,
            NODE_LEASE_NAMESPACE,
            {"spec": manifest["spec"]},
            _content_type="application/merge-patch+json",
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        coordination.create_namespaced_lease(
            NODE_LEASE_NAMESPACE, client.V1Lease.model_validate(manifest)
        )


def _condition(kind: str, status: str, reason: str, message: str, stamp: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_time(now: datetime.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
