"""The one Event writer both programs use (`process.kube.events`): repeats fold into one
series, an object made again under the same name gets its own Event, and a failure is
logged (quietly for a namespace being deleted), never raised."""

from __future__ import annotations

import datetime as dt

import pytest

from process.kube.errors import api_error
from process.kube.events import EventWriter, regarding_of
from tests.support.fake_events import FakeEventsApi

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _pod(uid: str = "u1") -> dict[str, object]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid, "resourceVersion": "7"}}


def _writer(api: FakeEventsApi) -> EventWriter:
    ticks = iter(T0 + dt.timedelta(seconds=s) for s in range(100))
    return EventWriter(api, controller="c", instance="i", clock=lambda: next(ticks))


def _say(writer: EventWriter, uid: str = "u1", message: str = "no room") -> None:
    writer.write(
        "ns",
        regarding_of(_pod(uid), "v1", "Pod"),
        type_="Warning",
        reason="NoCapacity",
        message=message,
        action="Place",
    )


def test_repeats_fold_into_one_event_whose_series_counts_them() -> None:
    api = FakeEventsApi()
    w = _writer(api)
    for _ in range(3):
        _say(w)
    (event,) = api.events.values()
    assert event["series"] == {"count": 3, "lastObservedTime": "2026-01-01T00:00:02.000000Z"}
    assert event["eventTime"] == "2026-01-01T00:00:00.000000Z"
    assert event["regarding"]["uid"] == "u1"
    assert (event["reportingController"], event["reportingInstance"]) == ("c", "i")
    assert [m for m, _, _ in api.requests] == ["POST", "PATCH", "PATCH"]


def test_another_message_is_another_event() -> None:
    api = FakeEventsApi()
    w = _writer(api)
    _say(w, message="no room")
    _say(w, message="no room on node-a")
    assert len(api.events) == 2
    assert all("series" not in e for e in api.events.values())


def test_an_object_made_again_under_the_same_name_gets_its_own_event() -> None:
    """The old object's Event must not count the new one's: its `regarding` names the old
    UID, and `kubectl describe` of the new object would show nothing."""
    api = FakeEventsApi()
    w = _writer(api)
    _say(w, uid="u1")
    _say(w, uid="u2")
    assert sorted(e["regarding"]["uid"] for e in api.events.values()) == ["u1", "u2"]


def test_an_event_written_before_a_restart_is_counted_on() -> None:
    api = FakeEventsApi()
    _say(_writer(api))
    _say(_writer(api))  # a new process: it does not remember the series, the apiserver does
    (event,) = api.events.values()
    assert event["series"]["count"] == 2


def test_a_refusal_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    api = FakeEventsApi(fail=api_error(403, "events.events.k8s.io is forbidden"))
    with caplog.at_level("WARNING"):
        _say(_writer(api))
    assert "could not post event NoCapacity on Pod ns/p" in caplog.text
    assert "forbidden" in caplog.text


def test_a_terminating_namespace_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """A lost node's leftover claims often sit in namespaces being deleted: their events are
    refused with 403 NamespaceTerminating, which is no error worth a warning."""
    body = '{"reason":"Forbidden","details":{"causes":[{"reason":"NamespaceTerminating"}]}}'
    api = FakeEventsApi(fail=api_error(403, body))
    with caplog.at_level("WARNING"):
        _say(_writer(api))
    assert api.requests  # it was tried
    assert not caplog.records
