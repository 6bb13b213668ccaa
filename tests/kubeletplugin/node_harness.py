"""Test harness for the prepare state machine: a simulated node plus an in-memory claim API.

The claim API is the one seam the tests replace (kubeletplugin.claims.ClaimClient); everything
else is real: the NVML backend over the simulator's file-backed state, CDI files, checkpoint.
"""

from __future__ import annotations

import threading
import uuid as uuidlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.cdi import CdiWriter
from driver.naming import gpu_device_name, mig_device_name
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.claims import ClaimGoneError, ClaimSnapshot, parse_claim
from kubeletplugin.foreign import ForeignPolicy
from kubeletplugin.ports import ClaimRef
from kubeletplugin.prepare import Preparer, PreparerSettings
from kubeletplugin.warm import WarmSettings

DRIVER = "mig.carve.dev"
NODE = "node-a"


def mig(backend: NvmlBackend, minor: int, profile_id: int, start: int) -> str:
    """The published device name for a profile id + placement start on GPU `minor`."""
    gpu = next(g for g in backend.gpus() if g.minor == minor)
    prof = gpu.profile(profile_id)
    assert prof is not None, f"gpu-{minor} has no profile {profile_id}"
    return mig_device_name(minor, prof.name, profile_id, start)


def whole(minor: int) -> str:
    return gpu_device_name(minor)


@dataclass
class FakeClaims:
    """In-memory ResourceClaims with finalizer bookkeeping (the ClaimClient protocol)."""

    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reads: int = 0
    fail_finalizer_removal: bool = False
    status_writes: int = 0
    owned: dict[tuple[str, str, str], set[tuple[str, str, str]]] = field(default_factory=dict)

    def add(
        self,
        name: str,
        devices: Sequence[str | tuple[str, str, str]],
        *,
        namespace: str = "default",
        config: Sequence[Mapping[str, Any]] = (),
        allocated: bool = True,
        requests: Sequence[str] = (),
    ) -> ClaimRef:
        """Create an allocated claim; a device is a name (this driver, this node's pool) or a
        (driver, pool, device) triple. Each device is its own request (req0, req1, ...) unless
        ``requests`` names the request of each device (a request with a count)."""
        uid = str(uuidlib.uuid4())
        results = []
        for i, d in enumerate(devices):
            drv, pool, dev = (DRIVER, NODE, d) if isinstance(d, str) else d
            req = requests[i] if requests else f"req{i}"
            results.append({"request": req, "driver": drv, "pool": pool, "device": dev})
        obj: dict[str, Any] = {
            "metadata": {
                "namespace": namespace,
                "name": name,
                "uid": uid,
                "resourceVersion": "1",
                "finalizers": [],
            },
            "status": {
                "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": "p"}],
            },
        }
        if allocated:
            obj["status"]["allocation"] = {"devices": {"results": results, "config": list(config)}}
        with self.lock:
            self.objects[(namespace, name)] = obj
        return ClaimRef(namespace, name, uid)

    def delete(self, ref: ClaimRef) -> None:
        with self.lock:
            obj = self.objects[(ref.namespace, ref.name)]
            if obj["metadata"]["finalizers"]:
                obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            else:
                del self.objects[(ref.namespace, ref.name)]

    def finalizers(self, ref: ClaimRef) -> list[str]:
        with self.lock:
            obj = self.objects.get((ref.namespace, ref.name))
            return list(obj["metadata"]["finalizers"]) if obj else []

    # -- ClaimClient --
    def get(self, namespace: str, name: str) -> ClaimSnapshot | None:
        with self.lock:
            self.reads += 1
            obj = self.objects.get((namespace, name))
            return None if obj is None else parse_claim(obj)

    def add_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        with self.lock:
            obj = self.objects.get((namespace, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                raise ClaimGoneError(f"{namespace}/{name} gone")
            if finalizer not in obj["metadata"]["finalizers"]:
                obj["metadata"]["finalizers"].append(finalizer)

    def remove_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        if self.fail_finalizer_removal:
            raise ConnectionError("apiserver unreachable")
        with self.lock:
            obj = self.objects.get((namespace, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                return
            fins = obj["metadata"]["finalizers"]
            if finalizer in fins:
                fins.remove(finalizer)
            if not fins and "deletionTimestamp" in obj["metadata"]:
                del self.objects[(namespace, name)]

    def apply_device_status(
        self, namespace: str, name: str, uid: str, manager: str, entries: Sequence[Any]
    ) -> None:
        """Server-side apply of `status.devices` as far as carve relies on it: `manager`'s
        entries become `entries`; other entries stay."""
        with self.lock:
            obj = self.objects.get((namespace, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                return
            self.status_writes += 1
            mine = self.owned.setdefault((namespace, name, manager), set())
            keep = [
                e
                for e in obj["status"].get("devices") or []
                if (e["driver"], e["pool"], e["device"]) not in mine
            ]
            obj["status"]["devices"] = keep + [dict(e) for e in entries]
            mine.clear()
            mine.update((e["driver"], e["pool"], e["device"]) for e in entries)

    def holding(self, finalizer: str) -> list[ClaimSnapshot]:
        with self.lock:
            return [
                parse_claim(o)
                for o in self.objects.values()
                if finalizer in o["metadata"]["finalizers"]
            ]


@dataclass
class FakeKubeJson:
    """The plugin's KubeJson, capturing each request (method, path, body); `fail` makes every
    request raise, as an unreachable apiserver or a missing RBAC grant would."""

    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    fail: Exception | None = None

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self.fail is not None:
            raise self.fail
        self.requests.append((method, path, body))
        return dict(body) if isinstance(body, Mapping) else {}


@dataclass
class Node:
    """A simulated GPU node with a preparer; `restart()` builds a fresh preparer as a new
    process would (same NVML state, checkpoint and CDI directory)."""

    root: Path
    backend: NvmlBackend
    claims: FakeClaims
    policy: ForeignPolicy = ForeignPolicy.LEAVE
    preparer: Preparer | None = None
    offers_changed: int = 0  # how often the preparer said the node's offers changed
    warm: WarmSettings = field(default_factory=WarmSettings)
    node_events: list[tuple[str, str, str]] = field(default_factory=list)  # type, reason, text

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoint"

    def start(self, *, reconcile: bool = True) -> Preparer:
        if self.preparer is not None:
            self.preparer.close()
        self.preparer = Preparer(
            settings=PreparerSettings(
                DRIVER, NODE, NODE, foreign_policy=self.policy, warm=self.warm
            ),
            backend=self.backend,
            claims=self.claims,
            store=CheckpointStore(self.checkpoint_dir),
            cdi=CdiWriter(self.cdi_root, vendor=DRIVER),
            node_events=self,
            offers_changed=self._count_offers_changed,
        )
        if reconcile:
            self.preparer.reconcile()
        return self.preparer

    def event(self, *, type_: str, reason: str, message: str, action: str = "GpuHealth") -> None:
        """The node's Events (kubeletplugin.nodeevents.NodeEvents), kept in order."""
        self.node_events.append((type_, reason, message))

    def _count_offers_changed(self) -> None:
        self.offers_changed += 1

    @property
    def p(self) -> Preparer:
        assert self.preparer is not None
        return self.preparer

    def instances(self) -> list[tuple[int, int, int, int]]:
        """(gpu minor, profile id, placement start, CI count) of every live GI."""
        out = []
        for g in self.backend.gpus():
            if not self.backend.mig_enabled(g.uuid):
                continue
            for inst in self.backend.instances(g.uuid):
                out.append(
                    (g.minor, inst.profile_id, inst.placement.start, len(inst.compute_instances))
                )
        return sorted(out)

    def gpu_uuid(self, minor: int) -> str:
        return next(g.uuid for g in self.backend.gpus() if g.minor == minor)


def sim_config(root: Path, gpus: Iterable[Any], **options: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"state": str(root / "sim" / "state.json"), "gpus": list(gpus)}
    if options:
        data["options"] = options
    return data


def open_node(
    root: Path,
    gpus: Iterable[Any],
    *,
    policy: ForeignPolicy = ForeignPolicy.LEAVE,
    nvml_timeout: float | None = None,
    **options: Any,
) -> Node:
    """A node on the simulator; `nvml_timeout` gives its NVML calls a deadline (None: none)."""
    sim.configure(sim_config(root, gpus, **options))
    backend = NvmlBackend(sim, proc_root=sim.sim_proc_root(), timeout=nvml_timeout).open()
    return Node(root, backend, FakeClaims(), policy)


@contextmanager
def started_node(root: Path, gpus: Iterable[Any], **kw: Any) -> Iterator[Node]:
    """`open_node`, its preparer started; everything closed and the simulator unset after."""
    n = open_node(root, gpus, **kw)
    n.start()
    try:
        yield n
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


def mps_config(**mps: Any) -> list[dict[str, Any]]:
    """A claim's config asking for MPS sharing with these `mpsConfig` settings."""
    return [
        {
            "source": "FromClaim",
            "requests": [],
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": "mig.carve.dev/v1alpha1",
                    "kind": "MigDeviceConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": mps},
                },
            },
        }
    ]
