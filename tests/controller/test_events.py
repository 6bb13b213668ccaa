"""KubeRecorder against a fake EventsV1Api; the real apiserver's answers are in
tests/controller/cluster/test_status_cluster.py (repeated events fold into one series)."""

from __future__ import annotations

from typing import Any

from controller.events import KubeRecorder
from controller.objects import Kind

Obj = dict[str, Any]


class _RawAnswer:
    """A raw urllib3 answer: counts whether anyone read it (reading returns the connection)."""

    def __init__(self) -> None:
        self.reads = 0

    @property
    def data(self) -> bytes:
        self.reads += 1
        return b"{}"


class _Api:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answers: list[_RawAnswer] = []

    def _answer(self, op: str, options: dict[str, Any]) -> _RawAnswer:
        self.calls.append((op, options))
        self.answers.append(_RawAnswer())
        return self.answers[-1]

    def create_namespaced_event(self, ns: str, body: Obj, **options: Any) -> _RawAnswer:
        return self._answer("create", options)

    def patch_namespaced_event(self, name: str, ns: str, body: Obj, **options: Any) -> _RawAnswer:
        return self._answer("patch", options)


def test_events_are_written_without_building_the_clients_model_of_the_answer() -> None:
    """The client's typed model of each answer cost more CPU than the write; the raw answer
    is read all the same, so the connection goes back to the pool."""
    api = _Api()
    rec = KubeRecorder(api)
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
    rec.event(pod, Kind.POD, "Normal", "Placed", "placed")
    rec.event(pod, Kind.POD, "Normal", "Placed", "placed")  # the same event: a series
    assert [op for op, _ in api.calls] == ["create", "patch"]
    assert all(options.get("_preload_content") is False for _, options in api.calls)
    assert [a.reads for a in api.answers] == [1, 1]
