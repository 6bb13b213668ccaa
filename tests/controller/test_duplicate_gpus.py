"""A GPU UUID that a second node publishes is told on both nodes and counted, and never takes
the first node's GPU away from the model (issue 41.3)."""

from __future__ import annotations

import json
import logging

import pytest

from controller.metrics import ControllerMetrics
from controller.objects import EventType, Kind
from controller.planner import EnginePlanner
from driver.apiobject import Obj
from tests.support.engine_cluster import DRIVER, engine_reconciler, node, slices


def _slices_claiming(thief: str, victim: str) -> list[Obj]:
    """`thief`'s slices, publishing `victim`'s GPU UUID as its own (a copied simulator
    config, a wrong --node-name, or a compromised plugin)."""
    text = json.dumps(slices(thief, ["H100-SXM5-80GB"]))
    out: list[Obj] = json.loads(text.replace(f"GPU-{thief}-0", f"GPU-{victim}-0"))
    return out


def test_a_second_node_with_a_gpus_uuid_is_told_on_both_nodes_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics, now = ControllerMetrics(), [100.0]
    planner = EnginePlanner(DRIVER)
    rec, recorder = engine_reconciler(metrics, now, planner=planner)
    for name in ("victim", "thief"):
        rec.enqueue(Kind.NODE, EventType.ADDED, node(name))
    for s in slices("victim", ["H100-SXM5-80GB"]):
        rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    rec.step()
    with caplog.at_level(logging.INFO, logger="controller.duplicategpus"):
        for s in _slices_claiming("thief", "victim"):
            rec.enqueue(Kind.SLICE, EventType.ADDED, s)
        rec.step()
        told = [e for e in recorder.events if e[2] == "DuplicateGpuUuid"]
        assert sorted(e[0] for e in told) == ["thief", "victim"]
        for _, type_, _, message in told:
            assert type_ == "Warning"
            assert "GPU GPU-victim-0 is published by nodes victim and thief" in message
            assert "carve counts it on victim" in message
        assert metrics.registry.get_sample_value("carve_duplicate_gpus") == 1
        assert planner.model.gpus["GPU-victim-0"].node == "victim"
        assert any("duplicate GPU UUID" in r.getMessage() for r in caplog.records)

        rec.step()  # nothing changed: not told again
        assert len([e for e in recorder.events if e[2] == "DuplicateGpuUuid"]) == 2
        now[0] += 301  # still there after event_interval: told again (events expire)
        rec.step()
        assert len([e for e in recorder.events if e[2] == "DuplicateGpuUuid"]) == 4

        for s in _slices_claiming("thief", "victim"):
            rec.enqueue(Kind.SLICE, EventType.DELETED, s)
        rec.step()
        assert metrics.registry.get_sample_value("carve_duplicate_gpus") == 0
        assert any("no longer publishes GPU GPU-victim-0" in r.getMessage() for r in caplog.records)
