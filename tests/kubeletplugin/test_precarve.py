"""Carve before bind on the node: which claims the agent carves ahead of the kubelet, what it
reports in `status.devices`, and that a GPU-level failure taints the GPU before the verdict.

The preparer and the status writer are stand-ins here (the real ones run against a real
apiserver in tests/e2e/test_binding_conditions.py); what is checked is the decision logic.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from driver.contract import DEFAULT_CONTRACT
from kubeletplugin.checkpoint import Checkpoint, ClaimRecord, ClaimState
from kubeletplugin.claims import ClaimFormatError
from kubeletplugin.ports import ClaimRef, PreparedDevice, PrepareResult
from kubeletplugin.precarve import (
    CarveFailures,
    CarveTarget,
    PreCarver,
    Verdict,
    carve_target,
    device_status_entries,
)

C = DEFAULT_CONTRACT
DRIVER = C.driver
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
DEVICE = "gpu-1-mig-1g10gb-19-6"


def _claim(
    *,
    pool: str = "node-a",
    conditions: bool = True,
    devices_status: list[dict[str, Any]] | None = None,
    deleting: bool = False,
    allocated: bool = True,
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "mig", "driver": DRIVER, "pool": pool, "device": DEVICE}
    if conditions:
        result["bindingConditions"] = [C.carved_condition]
        result["bindingFailureConditions"] = [C.carve_failed_condition]
    meta: dict[str, Any] = {"namespace": "ns", "name": "c", "uid": "u1", "resourceVersion": "7"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T12:00:00Z"
    status: dict[str, Any] = {}
    if allocated:
        status["allocation"] = {"devices": {"results": [result]}}
    if devices_status is not None:
        status["devices"] = devices_status
    return {"metadata": meta, "status": status}


def _verdict_entry(type_: str, status: str = "True", driver: str = DRIVER) -> dict[str, Any]:
    return {
        "driver": driver,
        "pool": "node-a",
        "device": DEVICE,
        "conditions": [{"type": type_, "status": status, "reason": "R", "message": "m"}],
    }


def test_a_claim_allocated_here_with_the_condition_is_a_target() -> None:
    target = carve_target(_claim(), contract=C, pool="node-a")
    assert target is not None
    assert target.ref == ClaimRef("ns", "c", "u1")
    assert [d.device for d in target.devices] == [DEVICE]


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (_claim(pool="node-b"), "allocated to another node"),
        (_claim(conditions=False), "no binding conditions (previous flow)"),
        (_claim(deleting=True), "being deleted"),
        (_claim(allocated=False), "not allocated"),
        (_claim(devices_status=[_verdict_entry(C.carved_condition)]), "already carved"),
        (_claim(devices_status=[_verdict_entry(C.carve_failed_condition)]), "already failed"),
    ],
)
def test_other_claims_are_not_targets(claim: dict[str, Any], why: str) -> None:
    assert carve_target(claim, contract=C, pool="node-a") is None, why


def test_a_verdict_of_another_driver_or_a_false_one_does_not_count() -> None:
    others = [
        _verdict_entry(C.carved_condition, driver="gpu.nvidia.com"),
        _verdict_entry(C.carved_condition, status="False"),
    ]
    assert carve_target(_claim(devices_status=others), contract=C, pool="node-a") is not None


def test_a_claim_carve_cannot_read_is_refused_by_name() -> None:
    bad = _claim()
    bad["status"]["allocation"]["devices"]["results"][0]["bindingConditions"] = "Carved"
    with pytest.raises(ClaimFormatError, match=r"results\[0\]\.bindingConditions: expected"):
        carve_target(bad, contract=C, pool="node-a")


def test_status_entries_keep_other_drivers_and_set_both_conditions() -> None:
    target = carve_target(_claim(), contract=C, pool="node-a")
    assert target is not None
    theirs = {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0", "data": {"x": 1}}
    old_ours = _verdict_entry(C.carve_failed_condition)
    old_ours["conditions"].append({"type": "Other", "status": "True", "reason": "R"})
    entries = device_status_entries(
        [theirs, old_ours],
        target.devices,
        Verdict(True, "Carved", "ok"),
        contract=C,
        now=NOW,
    )
    assert entries[0] == theirs
    conditions = {c["type"]: c for c in entries[1]["conditions"]}
    assert conditions[C.carved_condition]["status"] == "True"
    assert conditions[C.carve_failed_condition]["status"] == "False"
    assert conditions["Other"]["status"] == "True"
    assert conditions[C.carved_condition]["lastTransitionTime"] == "2026-12-01T12:00:00Z"
    new = device_status_entries(
        [], target.devices, Verdict(False, "CarveFailed", "x" * 40000), contract=C, now=NOW
    )
    (entry,) = new
    assert entry == {**entry, "driver": DRIVER, "pool": "node-a", "device": DEVICE}
    failed = {c["type"]: c for c in entry["conditions"]}
    assert failed[C.carve_failed_condition]["status"] == "True"
    assert len(failed[C.carve_failed_condition]["message"]) == 32768


class _Preparer:
    def __init__(self, result: PrepareResult, order: list[str]) -> None:
        self.result = result
        self.calls: list[ClaimRef] = []
        self.released = 0
        self.order = order
        self.gate = threading.Event()
        self.gate.set()
        self.uids: set[str] = set()

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        self.gate.wait(5)
        self.calls.extend(claims)
        self.order.append("prepare")
        return {c.uid: self.result for c in claims}

    def retry_pending(self) -> None:
        self.released += 1

    def checkpoint(self) -> Checkpoint:
        cp = Checkpoint()
        for uid in self.uids:
            cp = cp.with_claim(_record(uid))
        return cp


def _record(uid: str) -> ClaimRecord:
    return ClaimRecord(uid, "ns", "c", ClaimState.PREPARE_COMPLETED, ())


class _Status:
    def __init__(self, order: list[str]) -> None:
        self.reports: list[tuple[CarveTarget, Verdict]] = []
        self.order = order

    def report(self, target: CarveTarget, verdict: Verdict) -> None:
        self.order.append("report")
        self.reports.append((target, verdict))


def _carver(result: PrepareResult) -> tuple[PreCarver, _Preparer, _Status, list[str]]:
    order: list[str] = []
    preparer = _Preparer(result, order)
    status = _Status(order)
    carver = PreCarver(
        preparer=preparer,
        status=status,
        contract=C,
        pool="node-a",
        gpu_uuids={1: "GPU-1"},
        failures=CarveFailures(C.carve_failed_taint_key, 300.0),
        on_taints_changed=lambda: order.append("taint published"),
    )
    return carver, preparer, status, order


def test_a_successful_carve_is_reported_carved() -> None:
    ok = PrepareResult(devices=(PreparedDevice(("mig",), "node-a", DEVICE, ("cdi",)),))
    carver, preparer, status, order = _carver(ok)
    carver.on_claim("ADDED", _claim())
    carver.close()
    assert preparer.calls == [ClaimRef("ns", "c", "u1")]
    ((_, verdict),) = status.reports
    assert verdict.carved and verdict.reason == "Carved" and DEVICE in verdict.message
    assert order == ["prepare", "report"]
    assert carver.failures.taints() == {}


def test_an_nvml_failure_taints_the_gpu_before_the_failure_is_reported() -> None:
    failed = PrepareResult(
        error="ns/c: creating 1g.10gb failed: Unknown Error", reason="carve-failed"
    )
    carver, _, status, order = _carver(failed)
    carver.on_claim("ADDED", _claim())
    carver.close()
    ((_, verdict),) = status.reports
    assert not verdict.carved and verdict.reason == "CarveFailed"
    assert "Unknown Error" in verdict.message
    assert order == ["prepare", "taint published", "report"]
    assert carver.failures.taints() == {
        "GPU-1": ({"key": C.carve_failed_taint_key, "effect": "NoSchedule"},)
    }


def test_a_claim_level_failure_is_reported_without_tainting_the_gpu() -> None:
    bad = PrepareResult(error="ns/c: invalid opaque config: x", reason="bad-config")
    carver, _, status, order = _carver(bad)
    carver.on_claim("ADDED", _claim())
    carver.close()
    ((_, verdict),) = status.reports
    assert verdict.reason == "BadConfig" and not verdict.carved
    assert order == ["prepare", "report"]


def test_a_claim_that_went_away_meanwhile_gets_no_verdict() -> None:
    gone = PrepareResult(error="ns/c: ResourceClaim is being deleted", reason="claim-deleted")
    carver, _, status, _ = _carver(gone)
    carver.on_claim("ADDED", _claim())
    carver.close()
    assert status.reports == []


def test_events_for_a_claim_being_carved_start_no_second_carve() -> None:
    ok = PrepareResult(devices=(PreparedDevice(("mig",), "node-a", DEVICE, ("cdi",)),))
    carver, preparer, status, _ = _carver(ok)
    preparer.gate.clear()
    carver.on_claim("ADDED", _claim())
    carver.on_claim("MODIFIED", _claim())
    preparer.gate.set()
    carver.close()
    assert len(preparer.calls) == 1 and len(status.reports) == 1


def test_a_carved_claim_whose_allocation_went_away_is_released_at_once() -> None:
    carver, preparer, _, _ = _carver(PrepareResult())
    preparer.uids = {"u1"}
    carver.on_claim("MODIFIED", _claim(allocated=False))
    carver.on_claim("MODIFIED", _claim(pool="node-b"))
    carver.on_claim("DELETED", _claim())
    carver.on_claim("MODIFIED", _claim(devices_status=[_verdict_entry(C.carved_condition)]))
    carver.close()
    assert preparer.released == 3  # not for the claim still allocated here
    assert preparer.calls == []


def test_an_unreadable_claim_is_skipped_and_tears_nothing_down() -> None:
    carver, preparer, status, _ = _carver(PrepareResult())
    preparer.uids = {"u1"}
    bad = _claim()
    bad["status"]["allocation"]["devices"]["results"][0]["pool"] = 5
    carver.on_claim("MODIFIED", bad)
    carver.close()
    assert preparer.calls == [] and preparer.released == 0 and status.reports == []


def test_carve_failure_taints_expire_after_the_cooldown() -> None:
    now = [0.0]
    failures = CarveFailures("k", 60.0, clock=lambda: now[0])
    assert failures.add(["GPU-1"])
    assert not failures.add(["GPU-1"])  # already tainted: nothing new to publish
    now[0] = 59.0
    assert not failures.expire() and "GPU-1" in failures.taints()
    now[0] = 61.0
    assert failures.expire() and failures.taints() == {}
    assert not CarveFailures("k", 0.0).add(["GPU-1"])  # cooldown 0: never tainted
