"""controller.reminders: a lasting fault is told again once per interval, at once when its
detail changes, and forgotten when it ends."""

from __future__ import annotations

from controller.reminders import Reminders


def test_a_lasting_fault_is_told_once_per_interval_and_again_when_its_detail_changes() -> None:
    told: Reminders[str, str] = Reminders(interval=60.0)
    assert not told
    assert told.due("node-a", "v3", now=0.0)
    assert not told.due("node-a", "v3", now=59.0)
    assert told.due("node-a", "v4", now=59.5)  # the detail changed
    assert not told.due("node-a", "v4", now=100.0)
    assert told.due("node-a", "v4", now=119.5)  # an interval since it was last told
    assert told.last("node-a") == "v4"


def test_an_ended_fault_is_forgotten_and_told_at_once_if_it_comes_back() -> None:
    told: Reminders[str, str] = Reminders(interval=60.0)
    told.due("node-a", "v3", now=0.0)
    told.due("node-b", "v0", now=0.0)
    assert told.ended({"node-b"}) == [("node-a", "v3")]
    assert told.last("node-a") is None
    assert told.due("node-a", "v3", now=1.0)
    assert not told.due("node-b", "v0", now=1.0)
