"""The reconciler's test harness (tests/controller/test_reconciler*.py and the suites that drive
the reconciler without a cluster): API-shaped claims and pods, a trivial first-fit planner
standing in for the placement engine, an in-memory object store with resourceVersions as the
writer, and an event recorder."""

from __future__ import annotations

import copy
import datetime as dt
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from controller.autoscaling import (
    SAFE_TO_EVICT,
    hint_of,
    hint_ops,
    reset_ops,
    wants_protection,
)
from controller.config import ReconcilerConfig
from controller.extended_resources import pinned_affinity
from controller.objects import ClaimAllocation, EventType, Kind, Plan, Unplaceable
from controller.reconciler import Reconciler
from controller.status import build_allocation_status
from driver.allocation import AllocatedDevice
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT, HANDED_TO_SCHEDULER
from tests.support.patch_store import json_patch

ALLOCATION_FINALIZER = DEFAULT_CONTRACT.allocation_finalizer
SCHEDULING_GATE = DEFAULT_CONTRACT.scheduling_gate

NODE_FINALIZER = "mig.carve.dev/node-a"
_uid = itertools.count(1)


def _meta(name: str, ns: str | None = "ns", **extra: Any) -> Obj:
    meta: Obj = {"name": name, "uid": f"uid-{next(_uid)}", "resourceVersion": "1"}
    if ns is not None:
        meta["namespace"] = ns
    meta.update(extra)
    return meta


def claim(name: str, count: int = 1, cls: str = "mig.carve.dev", **meta: Any) -> Obj:
    return {
        "metadata": _meta(name, **meta),
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": cls, "count": count}}]
            }
        },
        "status": {},
    }


def pod(
    name: str,
    claims: Sequence[str],
    *,
    priority: int = 0,
    created: str = "2026-01-01T00:00:00Z",
    gated: bool = True,
) -> Obj:
    spec: Obj = {
        "resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)],
        "priority": priority,
    }
    if gated:
        spec["schedulingGates"] = [{"name": SCHEDULING_GATE}]
    return {
        "metadata": _meta(name, creationTimestamp=created),
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def node_slice(node: str, devices: int) -> Obj:
    return {
        "metadata": _meta(f"{node}-slice", ns=None),
        "spec": {
            "driver": "mig.carve.dev",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"dev-{i}"} for i in range(devices)],
        },
    }


def device_class(name: str = "mig.carve.dev") -> Obj:
    return {"metadata": _meta(name, ns=None), "spec": {}}


class FirstFitPlanner:
    """Test stand-in for the placement engine: devices are interchangeable slots per node."""

    def __init__(self) -> None:
        self.slices: dict[str, Obj] = {}
        self.claims: dict[str, Obj] = {}
        self.plans = 0
        self.committed_pods: list[str] = []
        self.verdict: Unplaceable | None = None  # when set, every plan is refused with it
        # Claims whose release would make room (`fits_after_release`), by store key.
        self.freeing: set[str] = set()

    def observe(self, kind: Kind, obj: Obj) -> None:
        key = f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
        if kind is Kind.SLICE:
            self.slices[key] = obj
        elif kind is Kind.CLAIM:
            self.claims[key] = obj

    def forget(self, kind: Kind, obj: Obj) -> None:
        key = f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
        (self.slices if kind is Kind.SLICE else self.claims).pop(key, None)

    def committed(self, pod: Obj, plan: Plan) -> None:
        self.committed_pods.append(pod["metadata"]["name"])

    def withdrawn(self, pod: Obj) -> None:
        self.committed_pods.remove(pod["metadata"]["name"])

    def problems(self) -> dict[str, Any]:
        return {}

    def duplicate_gpus(self) -> dict[tuple[str, str], str]:
        return {}

    def contract_skew(self) -> dict[str, str]:
        return {}

    def used(self) -> set[tuple[str, str]]:
        out = set()
        for c in self.claims.values():
            alloc = c.get("status", {}).get("allocation") or {}
            for r in alloc.get("devices", {}).get("results", []):
                out.add((r["pool"], r["device"]))
        return out

    def check_allocated(self, pod: Obj, claims: Sequence[Obj]) -> Unplaceable | None:
        return None

    def fits_after_release(self, pod: Obj, claims: Sequence[Obj], released: Any) -> bool:
        return bool(self.freeing.intersection(released))

    def plan(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        classes: Mapping[str, Obj],
        told: Unplaceable | None = None,
    ) -> Plan | Unplaceable:
        self.plans += 1
        if self.verdict is not None:
            return self.verdict
        used = self.used()
        want = {
            c["metadata"]["name"]: c["spec"]["devices"]["requests"][0]["exactly"]["count"]
            for c in claims
            if not c.get("status", {}).get("allocation")
        }
        for s in sorted(self.slices.values(), key=lambda s: s["spec"]["nodeName"]):
            node = s["spec"]["nodeName"]
            free = [d["name"] for d in s["spec"]["devices"] if (node, d["name"]) not in used]
            if len(free) < sum(want.values()):
                continue
            allocs = []
            for c in claims:
                n = want.get(c["metadata"]["name"], 0)
                if not n:
                    continue
                picked, free = free[:n], free[n:]
                allocs.append(
                    ClaimAllocation(
                        c["metadata"]["namespace"],
                        c["metadata"]["name"],
                        c["metadata"]["uid"],
                        node,
                        tuple(
                            AllocatedDevice("gpu", "mig.carve.dev", node, d, profile="1g.10gb")
                            for d in picked
                        ),
                    )
                )
            return Plan(node, tuple(allocs))
        return Unplaceable("NoCapacity", f"no node has {sum(want.values())} free devices")


class _NotFoundError(Exception):
    status = 404


class MemoryWriter:
    """In-memory object store with resourceVersions; optional injected failures per call."""

    def __init__(self) -> None:
        self.objects: dict[str, Obj] = {}
        self.calls: list[tuple[str, str]] = []
        self.reads: list[str] = []
        self.fail: dict[tuple[str, str], Exception] = {}
        self.conditions: dict[str, tuple[bool, str, str]] = {}
        # The pod writes that concern Cluster Autoscaler, in order (`controller.autoscaling`).
        self.pod_writes: list[tuple[str, str]] = []
        self._rv = itertools.count(100)

    def put(self, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.objects[obj["metadata"]["name"]] = obj
        return copy.deepcopy(obj)

    def _call(self, op: str, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        self.calls.append((op, name))
        if (op, name) in self.fail:
            raise self.fail.pop((op, name))
        return copy.deepcopy(self.objects.get(name, obj))

    def read_claim(self, claim: Obj) -> Obj:
        name = claim["metadata"]["name"]
        self.reads.append(name)  # apart from `calls`: those are the writes
        if ("read_claim", name) in self.fail:
            raise self.fail.pop(("read_claim", name))
        if name not in self.objects:
            raise _NotFoundError(name)
        return copy.deepcopy(self.objects[name])

    def add_finalizer(self, claim: Obj) -> Obj:
        if ALLOCATION_FINALIZER in (claim["metadata"].get("finalizers") or []):
            return claim  # as KubeClaimWriter: no request (carve's admission policy added it)
        cur = self._call("add_finalizer", claim)
        cur["metadata"].setdefault("finalizers", []).append(ALLOCATION_FINALIZER)
        return self.put(cur)

    def write_allocation(
        self, claim: Obj, allocation: ClaimAllocation, classes: Mapping[str, Obj]
    ) -> Obj:
        cur = self._call("write_allocation", claim)
        cur["status"]["allocation"] = build_allocation_status(
            cur, allocation, classes, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        )
        return self.put(cur)

    def clear_allocation(self, claim: Obj) -> Obj:
        cur = self._call("clear_allocation", claim)
        cur["status"].pop("allocation", None)
        cur["status"].pop("devices", None)  # as the real writer clears it
        return self.put(cur)

    def remove_finalizer(self, claim: Obj) -> Obj:
        cur = self._call("remove_finalizer", claim)
        cur["metadata"]["finalizers"] = [
            f for f in cur["metadata"].get("finalizers", []) if f != ALLOCATION_FINALIZER
        ]
        return self.put(cur)

    def remove_node_finalizer(self, claim: Obj, finalizer: str) -> Obj:
        cur = self._call("remove_node_finalizer", claim)
        cur["metadata"]["finalizers"] = [
            f for f in cur["metadata"].get("finalizers", []) if f != finalizer
        ]
        return self.put(cur)

    def hand_to_scheduler(self, claim: Obj) -> Obj:
        cur = self._call("hand_to_scheduler", claim)
        cur["metadata"]["finalizers"] = [
            f for f in cur["metadata"].get("finalizers", []) if f != ALLOCATION_FINALIZER
        ]
        annotations = cur["metadata"].setdefault("annotations", {})
        annotations[DEFAULT_CONTRACT.allocator_annotation] = HANDED_TO_SCHEDULER
        return self.put(cur)

    def remove_gate(self, pod: Obj, *, protect: bool = False) -> Obj:
        cur = self._call("remove_gate", pod)
        self._reset_first(cur)
        self.pod_writes.append(("remove_gate", cur["metadata"]["name"]))
        cur = self.current_of(cur)
        cur["spec"]["schedulingGates"] = [
            g for g in cur["spec"].get("schedulingGates", []) if g["name"] != SCHEDULING_GATE
        ]
        if protect and wants_protection(cur, DEFAULT_CONTRACT):
            cur["metadata"].setdefault("annotations", {})[SAFE_TO_EVICT] = "false"
        return self.put(cur)

    def current_of(self, obj: Obj) -> Obj:
        return copy.deepcopy(self.objects.get(obj["metadata"]["name"], obj))

    def _reset_first(self, pod: Obj) -> None:
        """As KubeClaimWriter: carve's hint goes before the gate does."""
        if hint_of(self.current_of(pod), SCHEDULING_GATE) is not None:
            self.reset_unschedulable(pod)

    def set_unschedulable(self, pod: Obj, message: str) -> Obj:
        """The hint as the real writer sets it (a JSON patch of the pod's status)."""
        cur = self.current_of(pod)
        self.pod_writes.append(("set_unschedulable", cur["metadata"]["name"]))
        ops = hint_ops(cur, SCHEDULING_GATE, message, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        return cur if ops is None else self.put(json_patch(cur, ops))

    def reset_unschedulable(self, pod: Obj) -> Obj:
        cur = self.current_of(pod)
        self.pod_writes.append(("reset_unschedulable", cur["metadata"]["name"]))
        ops = reset_ops(cur, SCHEDULING_GATE, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
        return cur if ops is None else self.put(json_patch(cur, ops))

    def pin_and_ungate(self, pod: Obj, node: str) -> Obj:
        cur = self._call("pin_and_ungate", pod)
        self._reset_first(cur)
        self.pod_writes.append(("pin_and_ungate", cur["metadata"]["name"]))
        cur = self.current_of(cur)
        if wants_protection(cur, DEFAULT_CONTRACT):
            cur["metadata"].setdefault("annotations", {})[SAFE_TO_EVICT] = "false"
        cur["spec"]["affinity"] = pinned_affinity(cur, node)
        cur["spec"]["schedulingGates"] = [
            g for g in cur["spec"].get("schedulingGates", []) if g["name"] != SCHEDULING_GATE
        ]
        return self.put(cur)

    def set_pod_condition(self, pod: Obj, status: bool, reason: str, message: str) -> None:
        self.conditions[pod["metadata"]["name"]] = (status, reason, message)


class ListRecorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []

    def event(self, obj: Obj, kind: Kind, type_: str, reason: str, message: str) -> None:
        self.events.append((obj["metadata"]["name"], type_, reason, message))


class Harness:
    def __init__(
        self,
        *,
        nodes: Mapping[str, int] = {"n1": 2},
        release_beside: Callable[[str, Callable[[], None]], bool] | None = None,
        commit_beside: Callable[[str, Callable[[], None]], bool] | None = None,
        metrics: Any = None,
        writer: MemoryWriter | None = None,
        preemption: Any = None,
        **cfg: Any,
    ) -> None:
        self.planner = FirstFitPlanner()
        self.writer = writer or MemoryWriter()
        self.recorder = ListRecorder()
        self.now = [1000.0]
        self.wall = [dt.datetime(2026, 1, 1, 0, 0, 10, tzinfo=dt.UTC)]
        self.rec = Reconciler(
            self.planner,
            self.writer,
            self.recorder,
            config=ReconcilerConfig(**cfg),
            clock=lambda: self.now[0],
            wall_clock=lambda: self.wall[0],
            release_beside=release_beside,
            commit_beside=commit_beside,
            metrics=metrics,
            preemption=preemption,
        )
        for k in Kind:
            self.rec.mark_synced(k)
        self.add(Kind.CLASS, device_class())
        for node, n in nodes.items():
            self.add(Kind.SLICE, node_slice(node, n))

    def add(self, kind: Kind, obj: Obj) -> Obj:
        if kind in (Kind.POD, Kind.CLAIM):
            obj = self.writer.put(obj)
        self.rec.enqueue(kind, EventType.ADDED, obj)
        return obj

    def update(self, kind: Kind, obj: Obj) -> Obj:
        obj = self.writer.put(obj)
        self.rec.enqueue(kind, EventType.MODIFIED, obj)
        return obj

    def current(self, name: str) -> Obj:
        return copy.deepcopy(self.writer.objects[name])

    def step(self) -> None:
        self.rec.step()

    def allocated_devices(self) -> list[tuple[str, str]]:
        out = []
        for o in self.writer.objects.values():
            alloc = o.get("status", {}).get("allocation")
            if alloc:
                out += [(r["pool"], r["device"]) for r in alloc["devices"]["results"]]
        return out


def count_classifications(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the pods `pod_work` classifies from now on, in order."""
    import controller.reconciler as reconciler_module

    seen: list[str] = []
    real = reconciler_module.pod_work

    def counting(p: Obj, *args: Any) -> Any:
        seen.append(p["metadata"]["name"])
        return real(p, *args)

    monkeypatch.setattr(reconciler_module, "pod_work", counting)
    return seen


class HeldWrites:
    """A stand-in for the release workers that runs writes only when told to."""

    def __init__(self, *, accept: bool = True) -> None:
        self.accept = accept
        self.held: list[tuple[str, Callable[[], None]]] = []

    def offer(self, key: str, write: Callable[[], None]) -> bool:
        if not self.accept:
            return False
        self.held.append((key, write))
        return True

    def run_all(self) -> None:
        held, self.held = self.held, []
        for _, write in held:
            write()
