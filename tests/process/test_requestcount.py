"""Every request through an ApiClient is counted once, named as the apiserver names it."""

from __future__ import annotations

from typing import Any

import pytest
import urllib3

from process.kube.requestcount import NO_ANSWER, count_requests, request_name

_BASE = "https://127.0.0.1:6443"


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [
        ("GET", "/api/v1/namespaces/ns/pods/p", ("get", "pods")),
        ("GET", "/api/v1/namespaces/ns/pods?limit=500", ("list", "pods")),
        ("GET", "/api/v1/pods?watch=true&resourceVersion=7", ("watch", "pods")),
        ("PATCH", "/api/v1/namespaces/ns/pods/p/status", ("patch", "pods/status")),
        ("PATCH", "/api/v1/namespaces/ns/pods/p", ("patch", "pods")),
        ("POST", "/apis/events.k8s.io/v1/namespaces/ns/events", ("create", "events")),
        (
            "PATCH",
            "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status",
            ("patch", "resourceclaims/status"),
        ),
        ("GET", "/apis/resource.k8s.io/v1/resourceslices", ("list", "resourceslices")),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", ("update", "leases")),
        ("DELETE", "/api/v1/namespaces/ns/pods", ("deletecollection", "pods")),
        ("POST", "/api/v1/namespaces/ns/pods/p/eviction", ("create", "pods/eviction")),
        ("GET", "/api/v1/namespaces/ns", ("get", "namespaces")),
        ("GET", "/metrics", ("get", "nonresource")),
    ],
)
def test_requests_are_named_as_the_apiserver_names_them(
    method: str, path: str, want: tuple[str, str]
) -> None:
    assert request_name(method, _BASE + path) == want


class _Rest:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.pool = "kept"

    def request(self, method: str, url: str, **_: Any) -> Any:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class _Answer:
    def __init__(self, status: int) -> None:
        self.status = status


class _Client:
    def __init__(self, rest: _Rest) -> None:
        self.rest_client = rest


def test_each_request_is_counted_with_its_status_or_no_answer() -> None:
    seen: list[tuple[str, str, str]] = []
    rest = _Rest([_Answer(200), _Answer(409), urllib3.exceptions.ProtocolError("reset")])
    client = count_requests(_Client(rest), lambda *k: seen.append(k))
    count_requests(client, lambda *k: seen.append(k))  # wrapping twice counts once
    pods = _BASE + "/api/v1/namespaces/ns/pods/p"
    assert client.rest_client.request("PATCH", pods, body={}).status == 200
    assert client.rest_client.request("PATCH", pods, body={}).status == 409
    with pytest.raises(urllib3.exceptions.ProtocolError):
        client.rest_client.request("GET", pods)
    assert seen == [("patch", "pods", "200"), ("patch", "pods", "409"), ("get", "pods", NO_ANSWER)]
    assert client.rest_client.pool == "kept"  # the rest of the wrapped client stays reachable


def test_the_controller_counts_what_its_client_sends() -> None:
    """The controller wires the counter to its one client: a request through any API object
    built on that client shows in carve_api_requests_total."""
    from kubernetes import client as k8s

    from controller.main import Controller, parse_options

    api = k8s.ApiClient(k8s.Configuration())
    api.rest_client = _Rest([_Answer(200)])  # type: ignore[assignment]
    ctl = Controller(api, parse_options(["--leader-elect=false", "--commit-workers=0"]))
    try:
        k8s.CoreV1Api(api).api_client.rest_client.request(
            "GET", _BASE + "/api/v1/namespaces/ns/pods/p"
        )
        got = ctl.metrics.registry.get_sample_value(
            "carve_api_requests_total", {"verb": "get", "resource": "pods", "outcome": "200"}
        )
        assert got == 1.0
    finally:
        ctl.shutdown()


class _JsonAnswer(_Answer):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.body = body

    def read(self) -> bytes:
        return self.body


def test_the_controllers_lists_and_events_through_its_json_client_are_counted() -> None:
    """The informers and the event writer use the JSON client, which rides on the same
    ApiClient: their requests are counted like any other."""
    from kubernetes import client as k8s

    from controller.main import Controller, parse_options
    from controller.objects import Kind

    api = k8s.ApiClient(k8s.Configuration())
    page = b'{"items": [], "metadata": {"resourceVersion": "1"}}'
    api.rest_client = _Rest([_JsonAnswer(200, page), _JsonAnswer(201, b"{}")])  # type: ignore[assignment]
    ctl = Controller(api, parse_options(["--leader-elect=false", "--commit-workers=0"]))
    try:
        next(i for i in ctl.informers if i.kind is Kind.SLICE)._list()
        pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
        ctl.recorder.event(pod, Kind.POD, "Normal", "Placed", "placed on n1")
        samples = {
            (verb, resource, outcome): ctl.metrics.registry.get_sample_value(
                "carve_api_requests_total",
                {"verb": verb, "resource": resource, "outcome": outcome},
            )
            for verb, resource, outcome in [
                ("list", "resourceslices", "200"),
                ("create", "events", "201"),
            ]
        }
        assert samples == {
            ("list", "resourceslices", "200"): 1.0,
            ("create", "events", "201"): 1.0,
        }
    finally:
        ctl.shutdown()
