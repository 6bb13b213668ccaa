"""The reconciler with the real placement engine behind `EnginePlanner`, fed ResourceSlices
built by `driver.resourceslice` exactly as the kubelet plugin publishes them (for
tests/controller/test_reconciler_engine.py and the suites built on it): nodes, slices, device
classes, claims for a profile, and `Cluster`, which submits and finishes pods."""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Callable
from typing import Any

from controller.objects import EventType, Kind
from controller.planner import EnginePlanner
from controller.reconciler import Reconciler
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.contract import DEFAULT_CONTRACT
from driver.resourceslice import PublishedGpu, build_resource_slices
from tests.support.reconciler import ListRecorder, MemoryWriter, claim, pod

SCHEDULING_GATE = DEFAULT_CONTRACT.scheduling_gate
DRIVER = "mig.carve.dev"


def node(name: str, cpu: str = "16") -> Obj:
    return {
        "metadata": {"name": name, "uid": f"node-{name}", "resourceVersion": "1"},
        "spec": {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": "64Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def slices(node_name: str, models: list[str], **build: Any) -> list[Obj]:
    gpus = [
        PublishedGpu(
            minor=i,
            uuid=f"GPU-{node_name}-{i}",
            model=gpu_model(m),
            pci_bus_id=f"0000:{i + 7:02x}:00.0",
            driver_version="580.105.08",
        )
        for i, m in enumerate(models)
    ]
    out = build_resource_slices(
        driver=DRIVER, node_name=node_name, pool_generation=1, gpus=gpus, **build
    )
    for s in out:
        s["metadata"].update(uid=s["metadata"]["name"], resourceVersion="1")
    return out


def device_class(name: str, kind: str) -> Obj:
    expr = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{kind}"'
    return {
        "metadata": {"name": name, "uid": name, "resourceVersion": "1"},
        "spec": {"selectors": [{"cel": {"expression": expr}}]},
    }


def engine_reconciler(
    metrics: Any,
    now: list[float],
    writer: MemoryWriter | None = None,
    planner: EnginePlanner | None = None,
) -> tuple[Reconciler, ListRecorder]:
    """The real engine behind a reconciler with every informer synced and carve's MIG class
    known; its clock reads `now[0]`. Nodes and slices are the caller's."""
    recorder = ListRecorder()
    rec = Reconciler(
        planner or EnginePlanner(DRIVER),
        writer or MemoryWriter(),
        recorder,
        metrics=metrics,
        clock=lambda: now[0],
        wall_clock=lambda: dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    )
    for k in Kind:
        rec.mark_synced(k)
    rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("mig.carve.dev", "mig"))
    return rec, recorder


def profile_claim(name: str, profile: str, count: int = 1) -> Obj:
    c = claim(name, count=count)
    c["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "{profile}"'}}
    ]
    return c


class Cluster:
    """`clock`: the reconciler's monotonic clock, e.g. a fake one a test advances."""

    def __init__(
        self,
        nodes: dict[str, list[str]],
        planner: EnginePlanner | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,
        **build: Any,
    ) -> None:
        self.planner = planner or EnginePlanner(DRIVER)
        self.writer = MemoryWriter()
        self.recorder = ListRecorder()
        self.rec = Reconciler(
            self.planner,
            self.writer,
            self.recorder,
            metrics=metrics,
            clock=clock,
            wall_clock=lambda: dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        )
        for k in Kind:
            self.rec.mark_synced(k)
        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("mig.carve.dev", "mig"))
        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("gpu.carve.dev", "gpu"))
        for n, models in nodes.items():
            self.rec.enqueue(Kind.NODE, EventType.ADDED, node(n))
            for s in slices(n, models, **build):
                self.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
        self._seq = itertools.count()

    def submit(self, c: Obj, prio: int = 0) -> str:
        i = next(self._seq)
        name = f"p{i}-{c['metadata']['name']}"
        self.rec.enqueue(Kind.CLAIM, EventType.ADDED, self.writer.put(c))
        p = pod(name, [c["metadata"]["name"]], priority=prio, created=f"2026-01-01T00:{i:02d}:00Z")
        self.rec.enqueue(Kind.POD, EventType.ADDED, self.writer.put(p))
        return name

    def finish(self, pod_name: str) -> None:
        p = self.writer.objects[pod_name]
        p["status"]["phase"] = "Succeeded"
        self.rec.enqueue(Kind.POD, EventType.MODIFIED, self.writer.put(p))

    def allocation(self, claim_name: str) -> Obj | None:
        alloc: Obj | None = self.writer.objects[claim_name]["status"].get("allocation")
        return alloc

    def events_of(self, name: str) -> list[tuple[str, str, str, str]]:
        return [e for e in self.recorder.events if e[0] == name]
