"""Conflicting allocations are never silent (issue 30.2).

Two claims allocated to one device by another allocator (kube-scheduler for a class of its own,
a hand edit) make the model block the GPU; the claims involved get a Warning event with the
way out, the log says so, and `carve_allocation_conflicts` counts the GPU, until one claim
lets go.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from controller.metrics import ControllerMetrics
from controller.objects import EventType, Kind
from controller.reconciler import Reconciler
from controller.status import node_selector_for
from driver.apiobject import Obj
from tests.support.engine_cluster import DRIVER, engine_reconciler, node, slices
from tests.support.reconciler import ListRecorder, MemoryWriter, claim, pod

DEVICE = "gpu-0-mig-7g80gb-0-0"


def _allocated(name: str, device: str = DEVICE) -> Obj:
    c = claim(name)
    c["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device}]
            },
            "nodeSelector": node_selector_for("n1"),
        }
    }
    return c


class _Metrics:
    def __init__(self) -> None:
        self.conflicts: list[int] = []

    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None: ...

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None: ...

    def set_queue_depth(self, depth: int) -> None: ...

    def count_outcome(self, outcome: str) -> None: ...

    def set_conflicts(self, gpus: int) -> None:
        self.conflicts.append(gpus)

    def set_duplicate_gpus(self, gpus: int) -> None:
        pass

    def set_contract_skew(self, nodes: int) -> None:
        pass


def _reconciler(
    metrics: Any, now: list[float], writer: MemoryWriter | None = None
) -> tuple[Reconciler, ListRecorder]:
    rec, recorder = engine_reconciler(metrics, now, writer)
    rec.enqueue(Kind.NODE, EventType.ADDED, node("n1"))
    for s in slices("n1", ["H100-SXM5-80GB"]):
        rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    return rec, recorder


def test_two_claims_on_one_device_are_told_on_both_claims_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, now = _Metrics(), [100.0]
    rec, recorder = _reconciler(metrics, now)
    a, b = _allocated("a"), _allocated("b")
    with caplog.at_level(logging.INFO, logger="controller.conflicts"):
        rec.enqueue(Kind.CLAIM, EventType.ADDED, a)
        rec.enqueue(Kind.CLAIM, EventType.ADDED, b)
        rec.step()
        told = [e for e in recorder.events if e[2] == "AllocationConflict"]
        assert sorted(e[0] for e in told) == ["a", "b"]
        for _, type_, _, message in told:
            assert type_ == "Warning"
            assert f"device {DEVICE} on node n1 is allocated to several claims: ns/a, ns/b" in (
                message
            )
            assert "docs/guide/troubleshooting.md" in message
        assert metrics.conflicts[-1] == 1
        assert any("allocation conflict:" in r.getMessage() for r in caplog.records)

        rec.step()  # nothing changed: not told again
        assert len([e for e in recorder.events if e[2] == "AllocationConflict"]) == 2

        now[0] += 301  # still there after event_interval: told again (events expire)
        rec.step()
        assert len([e for e in recorder.events if e[2] == "AllocationConflict"]) == 4

        freed = copy.deepcopy(b)
        freed["status"] = {}
        freed["metadata"]["resourceVersion"] = "2"
        rec.enqueue(Kind.CLAIM, EventType.MODIFIED, freed)
        rec.step()
        assert metrics.conflicts[-1] == 0
        assert any("allocation conflict resolved" in r.getMessage() for r in caplog.records)


def test_the_gauge_is_exported() -> None:
    metrics = ControllerMetrics()
    now = [0.0]
    rec, _ = _reconciler(metrics, now)
    rec.enqueue(Kind.CLAIM, EventType.ADDED, _allocated("a"))
    rec.enqueue(Kind.CLAIM, EventType.ADDED, _allocated("b", "gpu-0-mig-1g10gb-19-0"))
    rec.step()
    # 7g.80gb at 0 and 1g.10gb at 0 overlap on memory slice 0.
    assert metrics.registry.get_sample_value("carve_allocation_conflicts") == 1


def test_a_pod_whose_claim_is_in_a_conflict_stays_gated_until_one_claim_is_left() -> None:
    """Issue 41.4: before, `check_allocated` ungated such a pod, which then started on a
    device another claim also held."""
    metrics, now, writer = _Metrics(), [100.0], MemoryWriter()
    rec, recorder = _reconciler(metrics, now, writer)
    a, b = writer.put(_allocated("a")), writer.put(_allocated("b"))
    for c in (a, b):
        rec.enqueue(Kind.CLAIM, EventType.ADDED, c)
    rec.enqueue(Kind.POD, EventType.ADDED, writer.put(pod("p", ["a"])))
    rec.step()
    assert ("remove_gate", "p") not in writer.calls
    told = [e for e in recorder.events if e[0] == "p" and e[2] == "AllocationConflict"]
    assert told and "claim ns/a is in an allocation conflict" in told[0][3], recorder.events
    assert "keeps the pod gated until only one claim holds the device" in told[0][3]

    freed = copy.deepcopy(b)
    freed["status"] = {}
    rec.enqueue(Kind.CLAIM, EventType.MODIFIED, writer.put(freed))
    for _ in range(20):  # the pod's retry comes after its backoff
        now[0] += 30
        rec.step(timeout=0)
        if ("remove_gate", "p") in writer.calls:
            break
    assert ("remove_gate", "p") in writer.calls
