"""Lease leader election: the take-over rule, one leader among racing candidates, fencing.

`LeaseStore` stands in for the apiserver's optimistic concurrency on one Lease; the elector is
also run against the real kube-apiserver in tests/controller/cluster/test_controller_cluster.py.
"""

from __future__ import annotations

import copy
import datetime as dt
import threading
import time
from typing import Any

import pytest

from controller.leader import LeaderElector, LeaseConfig, may_take
from controller.liveness import LoopLiveness
from devcluster.waiting import wait_for
from tests.support.lease import LeaseResponse, LeaseStore


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _elector(store: LeaseStore, clock: Clock, who: str) -> LeaderElector:
    cfg = LeaseConfig(identity=who, lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
    epoch = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return LeaderElector(
        store, cfg, clock=clock, wall_clock=lambda: epoch + dt.timedelta(seconds=clock.t)
    )


def test_may_take_rules() -> None:
    held = {"holderIdentity": "a", "leaseDurationSeconds": 15}
    assert may_take({}, "b", 0, 0, 15)
    assert may_take(held, "a", 0, 0, 15)
    assert not may_take(held, "b", observed_at=100, now=114, lease_duration_s=15)
    assert may_take(held, "b", observed_at=100, now=115, lease_duration_s=15)
    assert may_take({"holderIdentity": ""}, "b", 100, 100, 15)


def test_one_leader_then_failover_after_expiry() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = _elector(store, clock, "a"), _elector(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.is_leader() and not b.is_leader()
    # a keeps renewing: b never takes over.
    for _ in range(10):
        clock.t += 2
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
    # a dies silently. b takes over only once it has seen no change for a lease duration.
    clock.t += 14
    assert not b.try_acquire_or_renew()
    assert not a.is_leader()  # past its renew deadline: fenced before b may win
    clock.t += 2
    assert b.try_acquire_or_renew()
    assert store.lease is not None
    assert store.lease["spec"]["holderIdentity"] == "b"
    assert store.lease["spec"]["leaseTransitions"] == 1


def test_race_for_an_expired_lease_has_one_winner() -> None:
    store, clock = LeaseStore(), Clock()
    a = _elector(store, clock, "a")
    assert a.try_acquire_or_renew()
    b, c = _elector(store, clock, "b"), _elector(store, clock, "c")
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock.t += 16
    # Both read the same expired lease; both write; optimistic concurrency lets one through.
    lease = copy.deepcopy(store.lease)
    orig = store.read_namespaced_lease
    store.read_namespaced_lease = lambda *a, **k: LeaseResponse(lease)  # type: ignore[method-assign]
    won = [b.try_acquire_or_renew(), c.try_acquire_or_renew()]
    store.read_namespaced_lease = orig  # type: ignore[method-assign]
    assert won.count(True) == 1


def test_leader_fences_itself_when_apiserver_unreachable() -> None:
    store, clock = LeaseStore(), Clock()
    a = _elector(store, clock, "a")
    assert a.try_acquire_or_renew()
    store.down = True
    clock.t += 9
    assert not a.try_acquire_or_renew()
    assert a.is_leader()  # still inside the renew deadline
    clock.t += 2
    assert not a.is_leader()


def test_release_lets_successor_in_without_waiting() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = _elector(store, clock, "a"), _elector(store, clock, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.stop(release=True)
    assert b.try_acquire_or_renew()


def test_inconsistent_timings_are_refused() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaseConfig(lease_duration_s=10, renew_deadline_s=10, retry_period_s=2)


class _SlowWrites(LeaseStore):
    """Every write is applied at once, and answered `delay` seconds of `clock` later."""

    def __init__(self, clock: Clock, delay: float) -> None:
        super().__init__()
        self._clock, self._delay = clock, delay

    def request(self, method: str, path: str, **kw: Any) -> Any:
        answer = super().request(method, path, **kw)
        if method in ("PUT", "POST"):
            self._clock.t += self._delay
        return answer


def test_a_renewal_counts_from_when_it_was_sent_not_when_it_was_answered() -> None:
    """Before, a renewal answered 9 s late fenced 10 s after the answer: the standby, which
    saw the write at once, may take the lease 15 s after it, so both led for 4 s."""
    clock = Clock()
    store = _SlowWrites(clock, delay=9.0)
    a, b = _elector(store, clock, "a"), _elector(store, clock, "b")
    sent = clock.t
    assert a.try_acquire_or_renew()  # answered at sent + 9
    assert not b.try_acquire_or_renew()  # b sees the new record now (sent + 9)
    clock.t = sent + 10
    assert not a.is_leader()  # fenced 10 s after sending, before b may take it
    clock.t = sent + 9 + 15
    assert b.try_acquire_or_renew()


def test_a_stuck_decision_loop_gives_the_lease_up() -> None:
    store = LeaseStore()
    cfg = LeaseConfig(identity="a", lease_duration_s=0.6, renew_deadline_s=0.4, retry_period_s=0.01)
    stuck = {"why": ""}
    a = LeaderElector(store, cfg, alive=lambda: stuck["why"])
    stopped = threading.Event()
    runner = threading.Thread(target=a.run, args=(lambda: None, stopped.set), daemon=True)
    runner.start()
    wait_for("a to lead", a.is_leader, timeout=5, interval=0.01)
    assert store.lease is not None
    stuck["why"] = "the decision loop has made no progress for 61s"
    assert stopped.wait(5)
    runner.join(5)
    assert not a.is_leader()
    last = store.lease["metadata"]["resourceVersion"]
    time.sleep(0.05)  # several retry periods: no renewal after giving up
    assert store.lease["metadata"]["resourceVersion"] == last
    assert store.lease["spec"]["holderIdentity"] == "a"  # left to expire, not released


def test_the_loop_heartbeat() -> None:
    clock = Clock()
    live = LoopLiveness(stall_s=60, clock=clock)
    assert live.check() == ""
    clock.t += 59
    assert live.check() == ""
    clock.t += 2
    assert "no progress for 61s (limit 60s)" in live.check()
    live.beat()
    assert live.check() == ""


def test_the_lease_declares_the_contract_version_the_controller_speaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plugins read it there (docs/architecture.md, Version skew); every renewal writes it
    again, so a controller rolled to another version declares the new one."""
    from driver import contract

    key = contract.Contract(contract.DEFAULT_DRIVER_NAME).contract_version_key
    store, clock = LeaseStore(), Clock()
    a = _elector(store, clock, "a")
    assert a.try_acquire_or_renew()
    assert store.lease is not None
    assert store.lease["metadata"]["annotations"] == {key: str(contract.CONTRACT_VERSION)}
    monkeypatch.setattr(contract, "CONTRACT_VERSION", 7)
    clock.t += 2
    assert a.try_acquire_or_renew()
    assert store.lease["metadata"]["annotations"][key] == "7"
