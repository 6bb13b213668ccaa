"""GPU health classification and its state machine (driver.gpuhealth)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.gpuhealth import (
    HealthConfigError,
    HealthPolicy,
    HealthTracker,
    Probe,
    Severity,
    TaintEffect,
    parse_effect,
    parse_xids,
)

KEY = "mig.carve.dev/gpu-unhealthy"


def test_xids_are_classified_as_nvidia_documents_them() -> None:
    policy = HealthPolicy()
    assert policy.xid(13) is Severity.HEALTHY  # an application's illegal access
    assert policy.xid(31) is Severity.HEALTHY  # an application's page fault
    assert policy.xid(79) is Severity.FATAL  # fallen off the bus
    assert policy.xid(48) is Severity.FATAL  # double-bit ECC
    assert policy.xid(92) is Severity.DEGRADED  # anything else
    custom = HealthPolicy(fatal_xids=frozenset({31}), ignored_xids=frozenset())
    assert custom.xid(31) is Severity.FATAL and custom.xid(79) is Severity.DEGRADED


def test_bad_settings_are_refused_with_what_is_allowed() -> None:
    with pytest.raises(
        HealthConfigError, match="--fatal-taint-effect: unknown taint effect 'Evict'"
    ):
        parse_effect("Evict", "--fatal-taint-effect")
    assert parse_effect("NoSchedule", "x") is TaintEffect.NO_SCHEDULE
    with pytest.raises(HealthConfigError, match="'x79' is not an XID"):
        parse_xids("48, x79", "--fatal-xids")
    assert parse_xids("48, 79,", "x") == {48, 79} and parse_xids("", "x") == frozenset()
    with pytest.raises(HealthConfigError, match=r"XIDs \[79\] are both fatal and ignored"):
        HealthPolicy(ignored_xids=frozenset({79}))


def test_fatal_xid_taints_no_execute_until_a_reset_is_seen() -> None:
    t = HealthTracker()
    assert t.probe("g", Probe(recovery_action=0, ecc_uncorrected=0), 0.0) is False
    assert t.xid("g", 79, 1.0) is True
    assert t.taints(KEY) == {"g": [{"key": KEY, "value": "xid-79", "effect": "NoExecute"}]}
    assert "fallen off the bus" in t.unhealthy()["g"]
    assert t.probe("g", Probe(recovery_action=1, ecc_uncorrected=0), 2.0) is False
    assert t.expire(10_000.0) == []  # time alone never clears a fatal condition
    assert t.probe("g", Probe(recovery_action=0, ecc_uncorrected=0), 3.0) is True  # reset
    assert t.taints(KEY) == {} and t.unhealthy() == {}


def test_degraded_xid_taints_no_schedule_and_clears_after_a_quiet_period() -> None:
    t = HealthTracker(HealthPolicy(recovery_seconds=60))
    assert t.xid("g", 92, 0.0) is True
    assert t.taints(KEY)["g"][0]["effect"] == "NoSchedule"
    assert t.xid("g", 92, 50.0) is False  # the same condition again: no change, timer restarts
    assert t.expire(100.0) == []
    assert t.xid("g", 79, 101.0) is True  # worse: fatal wins
    assert t.xid("g", 92, 102.0) is False  # milder events do not lower it
    assert t.taints(KEY)["g"][0]["effect"] == "NoExecute"
    assert t.xid("g", 13, 103.0) is False  # ignored


def test_uncorrected_ecc_by_event_or_counter_is_fatal_and_cleared_by_the_counter_reset() -> None:
    t = HealthTracker()
    assert t.ecc("g", uncorrected=False, now=0.0) is False
    t.probe("g", Probe(recovery_action=None, ecc_uncorrected=3), 0.0)
    assert t.ecc("g", uncorrected=True, now=1.0) is True
    assert t.probe("g", Probe(recovery_action=None, ecc_uncorrected=4), 2.0) is False
    assert t.probe("g", Probe(recovery_action=None, ecc_uncorrected=0), 3.0) is True
    # without events, a rising counter is what shows it
    assert t.probe("g", Probe(recovery_action=None, ecc_uncorrected=1), 4.0) is True
    assert t.conditions["g"].value == "ecc-uncorrected"


def test_a_reset_is_seen_by_the_ecc_counter_alone_when_no_recovery_action_is_reported() -> None:
    """Older drivers lack the recovery-action field: the volatile count restarting from the
    count seen while sick (here it went from 0 to 1 with the error) shows the reset."""
    t = HealthTracker()
    t.probe("g", Probe(recovery_action=None, ecc_uncorrected=0), 0.0)
    assert t.ecc("g", uncorrected=True, now=1.0) is True
    assert t.probe("g", Probe(recovery_action=None, ecc_uncorrected=1), 2.0) is False
    assert t.probe("g", Probe(recovery_action=None, ecc_uncorrected=0), 3.0) is True
    assert t.conditions == {}


def test_a_recovery_action_asked_for_is_fatal_even_without_an_event() -> None:
    t = HealthTracker(HealthPolicy(fatal_effect=TaintEffect.NO_SCHEDULE))
    assert t.probe("g", Probe(recovery_action=2), 0.0) is True
    assert t.taints(KEY)["g"][0] == {"key": KEY, "value": "recovery-needed", "effect": "NoSchedule"}
    assert "node reboot" in t.unhealthy()["g"]
    assert t.probe("g", Probe(recovery_action=0), 1.0) is True


def test_an_effect_of_none_reports_unhealthy_without_a_taint() -> None:
    t = HealthTracker(HealthPolicy(degraded_effect=TaintEffect.NONE))
    t.xid("g", 92, 0.0)
    assert t.taints(KEY) == {} and "g" in t.unhealthy()


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("xid"), st.sampled_from([13, 31, 48, 79, 92, 94, 119])),
            st.tuples(st.just("ecc"), st.booleans()),
            st.tuples(st.just("probe"), st.integers(0, 2)),
        ),
        max_size=12,
    )
)
def test_any_history_ends_healthy_after_a_reset_and_a_quiet_period(
    history: list[tuple[str, object]],
) -> None:
    t = HealthTracker(HealthPolicy(recovery_seconds=10))
    now = 0.0
    for kind, arg in history:
        now += 1
        if kind == "xid":
            t.xid("g", int(arg), now)  # type: ignore[call-overload]
        elif kind == "ecc":
            t.ecc("g", uncorrected=bool(arg), now=now)
        else:
            t.probe("g", Probe(recovery_action=int(arg), ecc_uncorrected=5), now)  # type: ignore[call-overload]
    # a reset: the driver asks for it, then it is done and the counters restart
    t.probe("g", Probe(recovery_action=1, ecc_uncorrected=5), now + 1)
    t.probe("g", Probe(recovery_action=0, ecc_uncorrected=0), now + 2)
    t.expire(now + 100)
    assert t.conditions == {} and t.taints(KEY) == {}


def test_a_lost_gpu_is_fatal_until_it_reads_again_with_nothing_pending() -> None:
    t = HealthTracker()
    assert t.lost("g", now=1.0)
    assert t.taints("k") == {"g": [{"key": "k", "value": "gpu-lost", "effect": "NoExecute"}]}
    assert "fallen off the bus" in t.unhealthy()["g"]
    assert not t.lost("g", now=2.0)  # still lost: nothing new to publish
    assert t.probe("g", Probe(recovery_action=0, ecc_uncorrected=0), now=3.0)  # reset
    assert t.unhealthy() == {}
    # an XID 79 first names the loss; the failing calls that follow keep its reason
    t.xid("h", 79, now=4.0)
    assert not t.lost("h", now=5.0)
    assert t.taints("k")["h"][0]["value"] == "xid-79"
