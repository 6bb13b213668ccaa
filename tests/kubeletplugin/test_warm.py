"""The pure warm-slice rules (kubeletplugin.warm): the state machine, scope and prediction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.catalog import Placement
from kubeletplugin.checkpoint import DeviceRecord, WarmInstance, WarmState
from kubeletplugin.warm import (
    Demand,
    WarmEvent,
    WarmSettings,
    WarmTransitionError,
    expired,
    in_the_way,
    keep_verdict,
    park,
    reusable_by,
    transition,
)

_DEVICE = DeviceRecord(
    "gpu-0-mig-1g10gb-19-3", ("r",), "node-a", "GPU-0", 0, 19, 3, 1, 9, 0, "MIG-9", ("c/d",)
)
_WARM = park(_DEVICE, "team-a", 100.0)


def test_park_takes_the_devices_instance() -> None:
    assert WarmInstance("GPU-0", 0, 9, 0, "MIG-9", 19, 3, 1, "team-a", 100.0) == _WARM
    with pytest.raises(WarmTransitionError):
        park(DeviceRecord("d", ("r",), "p", "GPU-0", 0, 19, 3, 1), "ns", 1.0)  # not carved


def test_the_transitions_and_nothing_else() -> None:
    assert transition(_WARM, WarmEvent.REUSE) is None
    reclaiming = transition(_WARM, WarmEvent.RECLAIM)
    assert reclaiming is not None and reclaiming.state is WarmState.RECLAIMING
    assert transition(reclaiming, WarmEvent.DESTROYED) is None
    assert transition(reclaiming, WarmEvent.VANISHED) is None
    for event in (WarmEvent.REUSE, WarmEvent.RECLAIM):
        with pytest.raises(WarmTransitionError):
            transition(reclaiming, event)  # a half-destroyed instance is never handed out
    with pytest.raises(WarmTransitionError):
        transition(_WARM, WarmEvent.DESTROYED)  # RECLAIMING is saved before any destroy


_starts = st.integers(0, 6)
_sizes = st.sampled_from([1, 2, 4, 7])


@given(
    start=_starts,
    size=_sizes,
    profile=st.sampled_from([19, 14, 9]),
    namespace=st.sampled_from(["team-a", "team-b"]),
    across=st.booleans(),
    state=st.sampled_from(list(WarmState)),
)
def test_reuse_only_exactly_there_idle_and_in_scope(
    *, start: int, size: int, profile: int, namespace: str, across: bool, state: WarmState
) -> None:
    warm = WarmInstance(**{**vars(_WARM), "state": state})
    ok = reusable_by(
        warm,
        WarmSettings(60.0, across),
        gpu_uuid="GPU-0",
        profile_id=profile,
        placement=Placement(start, size),
        namespace=namespace,
    )
    exact = (start, size, profile) == (3, 1, 19)
    assert ok == (exact and state is WarmState.IDLE and (across or namespace == "team-a"))
    assert not reusable_by(
        warm,
        WarmSettings(60.0, across),
        gpu_uuid="GPU-1",
        profile_id=19,
        placement=Placement(3, 1),
        namespace="team-a",
    )


@given(start=_starts, size=_sizes)
def test_in_the_way_means_sharing_a_memory_slice(start: int, size: int) -> None:
    overlaps = start < 4 and start + size > 3
    assert in_the_way(_WARM, "GPU-0", Placement(start, size)) == overlaps
    assert not in_the_way(_WARM, "GPU-1", Placement(start, size))
    assert in_the_way(_WARM, "GPU-0", None)  # the whole GPU


def test_expiry_and_keep_verdicts() -> None:
    on = WarmSettings(30.0)
    assert not expired(_WARM, on, 129.0) and expired(_WARM, on, 130.0)
    assert expired(_WARM, WarmSettings(), 100.0)  # off: every idle one goes
    reclaiming = transition(_WARM, WarmEvent.RECLAIM)
    assert reclaiming is not None and not expired(reclaiming, on, 1e9)
    assert expired(_WARM, on, 130.0, still_wanted=False)
    assert not expired(_WARM, on, 130.0, still_wanted=True)  # its profile still comes there
    assert expired(_WARM, WarmSettings(), 100.0, still_wanted=True)  # off wins
    assert keep_verdict(on, processes=[], predicted=True)[0]
    assert keep_verdict(on, processes=[], predicted=True, warm_on_gpu=7)[0]  # no limit
    capped = WarmSettings(30.0, max_per_gpu=2)
    assert keep_verdict(capped, processes=[], predicted=True, warm_on_gpu=1)[0]
    assert keep_verdict(capped, processes=[], predicted=True, warm_on_gpu=2) == (
        False,
        "the GPU already has 2 warm instance(s), the most it keeps",
    )
    assert keep_verdict(on, processes=[7, 3], predicted=True) == (
        False,
        "processes still run on it (pids 3, 7)",
    )
    assert not keep_verdict(on, processes=[], predicted=False)[0]
    assert not keep_verdict(WarmSettings(), processes=[], predicted=True)[0]


def test_a_profile_is_predicted_once_it_recurs_on_the_gpu_within_the_window() -> None:
    demand = Demand(window_s=30.0)
    demand.record("GPU-0", 19, 100.0)
    assert not demand.predicted("GPU-0", 19, 101.0)
    demand.record("GPU-0", 19, 110.0)
    assert demand.predicted("GPU-0", 19, 120.0)
    assert not demand.predicted("GPU-0", 14, 120.0)
    assert not demand.predicted("GPU-1", 19, 120.0)
    assert not demand.predicted("GPU-0", 19, 135.0)  # the first one left the window
