"""A graceful hand-over (issue 30.3): fence, drain, then release, as client-go's
ReleaseOnCancel requires.

A real `LeaderElector` renews a lease on `LeaseStore` (tests/controller/test_leader.py) from its
own thread; a real `WritePool` holds one write in flight (blocked until the test lets it go).
`controller.main.hand_over` is what `Controller.shutdown` runs. A successor with a clock of its
own (advanced past the lease duration between looks) must not win the lease while that write
can still land, and wins it at once when it has.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from controller.leader import LeaderElector, LeaseConfig
from controller.main import hand_over
from controller.writepool import WritePool
from tests.support.lease import LeaseStore

CFG = dict(lease_duration_s=1.0, renew_deadline_s=0.6, retry_period_s=0.05)


class _WatchedStore(LeaseStore):
    """LeaseStore that lets a test wait for the next write (a renewal)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()

    def _store(self, body: Any) -> Any:
        with self.changed:
            out = super()._store(body)
            self.changed.notify_all()
            return out

    def wait_for_write(self, after_rv: int, timeout: float = 5.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.rv > after_rv, timeout)


class _Successor:
    """A second replica whose clock the test moves: each look is one lease duration later
    than the one before (in real time, the leader's next renewal comes in between)."""

    def __init__(self, store: _WatchedStore) -> None:
        self.now = 0.0
        self.store = store
        self.elector = LeaderElector(
            store, LeaseConfig(identity="successor", **CFG), clock=lambda: self.now
        )

    def wins_a_lease_duration_later(self) -> bool:
        assert not self.elector.try_acquire_or_renew()  # observes the record as it is now
        assert self.store.wait_for_write(self.store.rv), "the lease is no longer renewed"
        self.now += CFG["lease_duration_s"] + 0.1
        return self.elector.try_acquire_or_renew()


def test_a_write_in_flight_keeps_the_lease_until_it_ends_then_it_is_handed_over() -> None:
    store = _WatchedStore()
    leader = LeaderElector(store, LeaseConfig(identity="leader", **CFG))
    started = threading.Event()
    threading.Thread(target=leader.run, args=(started.set, lambda: None), daemon=True).start()
    assert started.wait(5)

    pool = WritePool(workers=2)
    in_flight, let_go = threading.Event(), threading.Event()
    fence_when_it_ended: list[bool] = []

    def write() -> None:  # a request sent before the hand-over, answered after it began
        in_flight.set()
        let_go.wait(30)
        fence_when_it_ended.append(leader.is_leader())

    pool.offer("ns/claim", write)
    assert in_flight.wait(5)

    handed: list[bool] = []
    shutdown = threading.Thread(
        target=lambda: handed.append(hand_over(leader, [pool.drain], time.monotonic() + 30))
    )
    shutdown.start()
    successor = _Successor(store)
    for _ in range(3):
        assert not leader.is_leader(), "the fence is still open during the hand-over"
        assert not successor.wins_a_lease_duration_later(), "taken over mid-write"
        assert (store.lease or {})["spec"]["holderIdentity"] == "leader"

    let_go.set()
    shutdown.join(10)
    assert handed == [True]
    assert fence_when_it_ended == [False]  # a retry of that write would have stopped
    assert store.lease is not None and store.lease["spec"]["holderIdentity"] == ""
    assert successor.elector.try_acquire_or_renew()  # at once, no expiry to wait for


def test_a_write_that_outlives_the_deadline_leaves_the_lease_to_expire() -> None:
    store = _WatchedStore()
    leader = LeaderElector(store, LeaseConfig(identity="leader", **CFG))
    assert leader.try_acquire_or_renew()
    pool = WritePool(workers=1)
    stuck = threading.Event()
    pool.offer("ns/claim", lambda: stuck.wait(30))
    try:
        assert not hand_over(leader, [pool.drain], time.monotonic() + 0.2)
        assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "leader"
        assert not leader.is_leader()
    finally:
        stuck.set()
