"""What the controller reads from a node's carve report while it holds the pod's gate."""

from __future__ import annotations

import datetime as dt
from typing import Any

from controller.nodehealth.carvewait import CarveState, carve_verdict, plan_waits_for_carve
from driver.allocation import AllocatedDevice
from driver.contract import DEFAULT_CONTRACT

C = DEFAULT_CONTRACT
T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def _claim(
    devices: list[str], *, conditions: bool = True, reported: dict[str, str] | None = None
) -> dict[str, Any]:
    results = []
    for d in devices:
        r: dict[str, Any] = {"request": "mig", "driver": C.driver, "pool": "n1", "device": d}
        if conditions:
            r["bindingConditions"] = [C.carved_condition]
            r["bindingFailureConditions"] = [C.carve_failed_condition]
        results.append(r)
    status: dict[str, Any] = {
        "allocation": {
            "devices": {"results": results},
            "allocationTimestamp": "2026-12-01T12:00:00Z",
        }
    }
    if reported:
        status["devices"] = [
            {
                "driver": C.driver,
                "pool": "n1",
                "device": d,
                "conditions": [{"type": t, "status": "True", "message": f"{d} said so"}],
            }
            for d, t in reported.items()
        ]
    return {"metadata": {"namespace": "ns", "name": "c"}, "status": status}


def _verdict(*claims: dict[str, Any], at: float = 1.0, wait: float = 30.0) -> Any:
    return carve_verdict(list(claims), C.driver, T0 + dt.timedelta(seconds=at), wait)


def test_without_binding_conditions_nothing_is_waited_for() -> None:
    assert _verdict(_claim(["a"], conditions=False)).state is CarveState.NONE
    assert not plan_waits_for_carve([AllocatedDevice("r", C.driver, "n1", "a")])
    assert plan_waits_for_carve(
        [AllocatedDevice("r", C.driver, "n1", "a", binding_conditions=(C.carved_condition,))]
    )


def test_pending_until_every_device_is_carved() -> None:
    partly = _verdict(_claim(["a", "b"], reported={"a": C.carved_condition}), at=10)
    assert partly.state is CarveState.PENDING
    assert partly.waiting_for == ("n1/b",) and partly.wait_left == 20.0
    both = {"a": C.carved_condition, "b": C.carved_condition}
    assert _verdict(_claim(["a", "b"], reported=both)).state is CarveState.READY


def test_a_failure_wins_and_carries_the_nodes_message() -> None:
    v = _verdict(
        _claim(["a", "b"], reported={"a": C.carved_condition, "b": C.carve_failed_condition})
    )
    assert v.state is CarveState.FAILED
    (failure,) = v.failures
    assert (failure.claim, failure.device, failure.message) == ("ns/c", "n1/b", "b said so")


def test_no_report_within_the_wait_hands_over_to_the_scheduler() -> None:
    assert _verdict(_claim(["a"]), at=31).state is CarveState.TIMED_OUT
    assert _verdict(_claim(["a"]), at=29).state is CarveState.PENDING


def test_malformed_input_never_raises() -> None:
    bad = _claim(["a"])
    bad["status"]["allocation"]["devices"]["results"][0]["pool"] = 7
    assert _verdict(bad).state is CarveState.NONE  # not carve's shape: nothing to wait for
    odd = _claim(["a"])
    odd["status"]["devices"] = "nonsense"
    odd["status"]["allocation"]["allocationTimestamp"] = "yesterday"
    assert _verdict(odd, at=10_000).state is CarveState.PENDING  # no timestamp: full wait left
