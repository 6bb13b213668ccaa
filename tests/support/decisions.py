"""The machinery of `python -m bench.decisions` (see its docstring): the controller's planner
fed bench.scale's fleet in process, decisions timed in wall and thread-CPU time, garbage
collections inside a decision recorded."""

from __future__ import annotations

import copy
import datetime as dt
import gc
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from controller.objects import Kind, Plan
from controller.planner import EnginePlanner
from controller.status import build_allocation_status
from devcluster.nodes import FakeNode, node_manifest, node_status
from driver.apiobject import Obj
from tests.support.gpufleet import FLEET_LABEL, fleet_node, node_slices
from tests.support.real_allocator import device_classes
from tests.support.scale_pods import PROFILES, claim_template

_NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
_NAMESPACE = "bench"


@dataclass
class DecisionFigures:
    nodes: int
    decisions: int = 0
    placed: int = 0
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    # generation -> pauses (thread CPU seconds) of collections that ran inside a decision
    gc_pauses: dict[int, list[float]] = field(default_factory=dict)


def _with_identity(obj: Obj, name: str) -> Obj:
    obj["metadata"].update(uid=f"uid-{name}", resourceVersion="1")
    return obj


def fleet_objects(nodes: int, driver: str) -> Iterator[tuple[Kind, Obj]]:
    """What the controller's informers give it for `nodes` bench.scale fleet nodes and carve's
    DeviceClasses, in that order."""
    for c in device_classes(driver):
        yield Kind.CLASS, _with_identity(c, c["metadata"]["name"])
    for i in range(nodes):
        node = fleet_node(i)
        fake = FakeNode(name=node.name, labels={FLEET_LABEL: node.model_key})
        obj = node_manifest(fake)
        obj["status"] = node_status(fake, _NOW)["status"]
        yield Kind.NODE, _with_identity(obj, node.name)
        for s in node_slices(node, driver):
            yield Kind.SLICE, _with_identity(s, s["metadata"]["name"])


def _planner(nodes: int) -> tuple[EnginePlanner, dict[str, Obj]]:
    planner = EnginePlanner()
    classes = {}
    for kind, obj in fleet_objects(nodes, planner.driver):
        if kind is Kind.CLASS:
            classes[obj["metadata"]["name"]] = obj
        planner.observe(kind, obj)
    planner.flush()
    # As carve-controller does once its lists are in (controller/main.py, _freeze_heap): the
    # model's objects out of the collector's reach, so that no decision walks them all.
    gc.collect(1)
    gc.freeze()
    return planner, classes


def _claim(name: str, profile: str) -> Obj:
    spec = copy.deepcopy(claim_template(profile)["spec"]["spec"])
    meta = {"name": name, "namespace": _NAMESPACE}
    return _with_identity({"metadata": meta, "spec": spec, "status": {}}, name)


def _pod(name: str) -> Obj:
    spec = {
        "resourceClaims": [{"name": "mig", "resourceClaimName": name}],
        "containers": [
            {"name": "work", "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}
        ],
    }
    meta = {"name": name, "namespace": _NAMESPACE, "creationTimestamp": "2026-01-01T00:00:00Z"}
    return _with_identity({"metadata": meta, "spec": spec, "status": {"phase": "Pending"}}, name)


def run(nodes: int, decisions: int, live: int) -> DecisionFigures:
    planner, classes = _planner(nodes)
    figures = DecisionFigures(nodes)
    inside = [False]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if not inside[0]:
            return
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pause = time.thread_time() - started[0]
            figures.gc_pauses.setdefault(info["generation"], []).append(pause)

    running: deque[tuple[Obj, Obj]] = deque()
    gc.callbacks.append(on_gc)
    try:
        for i in range(decisions):
            name = f"pod-{i}"
            claim, pod = _claim(name, PROFILES[i % len(PROFILES)]), _pod(name)
            inside[0] = True
            wall, cpu = time.perf_counter(), time.thread_time()
            verdict = planner.plan(pod, [claim], classes)
            figures.cpu_s.append(time.thread_time() - cpu)
            figures.wall_s.append(time.perf_counter() - wall)
            inside[0] = False
            figures.decisions += 1
            if isinstance(verdict, Plan):
                figures.placed += 1
                planner.committed(pod, verdict)
                for allocation in verdict.allocations:
                    allocated = copy.deepcopy(claim)
                    allocated["status"] = {
                        "allocation": build_allocation_status(claim, allocation, classes, _NOW)
                    }
                    planner.observe(Kind.CLAIM, allocated)
                running.append((pod, claim))
            while len(running) > live:
                ended, its_claim = running.popleft()
                planner.observe(Kind.POD, {**ended, "status": {"phase": "Succeeded"}})
                planner.observe(Kind.CLAIM, its_claim)  # deallocated, as a release writes it
    finally:
        gc.callbacks.remove(on_gc)
    return figures


def _ms(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000 if ordered else 0.0


def report(f: DecisionFigures) -> str:
    lines = [
        f"decisions: {f.decisions} on {f.nodes} nodes x 8 GPUs, {f.placed} placed",
        f"{'':<6}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}",
    ]
    for label, values in (("wall", f.wall_s), ("cpu", f.cpu_s)):
        lines.append(
            f"{label:<6}{_ms(values, 0.5):>8.3f}{_ms(values, 0.99):>8.3f}{_ms(values, 1.0):>8.2f}"
        )
    for gen in sorted(f.gc_pauses):
        pauses = f.gc_pauses[gen]
        lines.append(
            f"gc generation {gen} inside a decision: {len(pauses)} times, "
            f"longest {max(pauses) * 1000:.2f} ms"
        )
    return "\n".join(lines)
