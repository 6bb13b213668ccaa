"""The machinery of `python -m bench.waiting` (see its docstring): carve's reconciler and
planner in process on bench.scale's fleet, filled, with a queue of pods waiting for room,
then pods ending one at a time; what each end costs the deciding thread."""

from __future__ import annotations

import copy
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from controller.objects import EventType, Kind, is_allocated
from controller.planner import EnginePlanner
from controller.reconciler import Reconciler
from tests.support.decisions import fleet_objects
from tests.support.reconciler import ListRecorder, MemoryWriter, pod
from tests.support.scale_pods import PROFILES, claim_template

_NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@dataclass
class WaitingFigures:
    label: str
    nodes: int
    submitted: int
    placed_at_start: int = 0
    ends: int = 0
    placed_after_ends: int = 0
    searches: int = 0  # the engine's searches over all ends
    cpu_s: list[float] = field(default_factory=list)  # the deciding thread's, per end

    @property
    def waiting(self) -> int:
        return self.submitted - self.placed_at_start


class _Fleet:
    """One reconciler with its planner, fed the fleet and carve's classes."""

    def __init__(self, nodes: int, shared_refusal_s: float) -> None:
        self.writer = MemoryWriter()
        self.planner = EnginePlanner(shared_refusal_s=shared_refusal_s)
        self.rec = Reconciler(self.planner, self.writer, ListRecorder(), wall_clock=lambda: _NOW)
        for k in Kind:
            self.rec.mark_synced(k)
        for kind, obj in fleet_objects(nodes, self.planner.driver):
            self.rec.enqueue(kind, EventType.ADDED, obj)
        self.rec.step()
        self.searches = 0
        place = self.planner.engine.place

        def counted(request: Any) -> Any:
            self.searches += 1
            return place(request)

        self.planner.engine.place = counted  # type: ignore[method-assign]

    def submit(self, name: str, profile: str) -> None:
        """A pod `p-<name>` with its claim `<name>` from bench.scale's template."""
        spec = copy.deepcopy(claim_template(profile)["spec"]["spec"])
        meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
        claim = {"metadata": meta, "spec": spec, "status": {}}
        self.rec.enqueue(Kind.CLAIM, EventType.ADDED, self.writer.put(claim))
        self.rec.enqueue(Kind.POD, EventType.ADDED, self.writer.put(pod(f"p-{name}", [name])))

    def placed(self, name: str) -> bool:
        return is_allocated(self.writer.objects[name])

    def end(self, name: str) -> None:
        """The pod ran to completion; the controller releases its claim."""
        ended = self.writer.objects[f"p-{name}"]
        ended["status"]["phase"] = "Succeeded"
        self.rec.enqueue(Kind.POD, EventType.MODIFIED, self.writer.put(ended))


def run(nodes: int, queued: int, ends: int, shared_refusal_s: float, label: str) -> WaitingFigures:
    """Fill `nodes` fleet nodes with `queued` pods at once (what does not fit waits), then end
    the oldest running pod `ends` times, one at a time."""
    fleet = _Fleet(nodes, shared_refusal_s)
    figures = WaitingFigures(label, nodes, queued)
    names = [f"w{i:05d}" for i in range(queued)]
    for i, name in enumerate(names):
        fleet.submit(name, PROFILES[i % len(PROFILES)])
    fleet.rec.step()
    running = [n for n in names if fleet.placed(n)]
    figures.placed_at_start = len(running)
    waiting = [n for n in names if n not in set(running)]
    fleet.searches = 0
    for _ in range(min(ends, len(running))):
        fleet.end(running.pop(0))
        cpu = time.thread_time()
        fleet.rec.step()  # the end: the claim released
        fleet.rec.step()  # the release written and seen: the waiting pods tried again
        figures.cpu_s.append(time.thread_time() - cpu)
        figures.ends += 1
        now = [n for n in waiting if fleet.placed(n)]
        figures.placed_after_ends += len(now)
        running.extend(now)
        waiting = [n for n in waiting if n not in set(now)]
    figures.searches = fleet.searches
    return figures


def report(runs: list[WaitingFigures]) -> str:
    lines = [
        f"{'sharing':<10}{'nodes':>6}{'pods':>7}{'waiting':>8}{'ends':>6}{'placed':>7}"
        f"{'searches/end':>13}{'cpu ms/end':>11}"
    ]
    for f in runs:
        per_end = f.searches / f.ends if f.ends else float("nan")
        cpu = sum(f.cpu_s) / f.ends * 1000 if f.ends else float("nan")
        lines.append(
            f"{f.label:<10}{f.nodes:>6}{f.submitted:>7}{f.waiting:>8}{f.ends:>6}"
            f"{f.placed_after_ends:>7}{per_end:>13.1f}{cpu:>11.2f}"
        )
    return "\n".join(lines)
