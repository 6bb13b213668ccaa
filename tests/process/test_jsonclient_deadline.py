"""The API client's bounds on one request and on a run of them (issue 45, item 5).

Before, the node agent's client kept urllib3's default of three retries at 10 s each, so one
claim read against an apiserver that does not answer took 40 s, and nothing bounded the calls
a start-up step made in all.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from process.kube.jsonclient import KubeJson, SharedDeadlineError, calls_within
from process.kubeconfig import load_api_client
from tests.support.stub_apiserver import StubApiserver


class _Response:
    status = 200

    def read(self) -> bytes:
        return b"{}"


class _Client:
    """The two ApiClient calls KubeJson makes; records each request's timeout."""

    def __init__(self, retries: int = 0) -> None:
        self.timeouts: list[float] = []
        self.configuration = type("Configuration", (), {"retries": retries})()

    def param_serialize(self, **kw: Any) -> tuple[str, str, dict[str, str], Any, None]:
        return kw["method"], kw["resource_path"], {}, kw.get("body"), None

    def call_api(self, *args: Any, _request_timeout: float, **kw: Any) -> _Response:
        self.timeouts.append(_request_timeout)
        return _Response()


def test_requests_inside_calls_within_share_one_deadline() -> None:
    now = [100.0]
    client = _Client()
    api = KubeJson(client, request_timeout=10.0)
    import process.kube.jsonclient as jc

    real = jc.time.monotonic
    jc.time.monotonic = lambda: now[0]  # type: ignore[assignment]
    try:
        with calls_within(4.0, "the start-up reconcile"):
            api.request("GET", "/a")
            now[0] += 3.0
            api.request("GET", "/b", timeout=30.0)
            now[0] += 1.5
            with pytest.raises(SharedDeadlineError) as e:
                api.request("PATCH", "/c")
        api.request("GET", "/d")  # outside: the client's own timeout again
    finally:
        jc.time.monotonic = real  # type: ignore[assignment]
    assert client.timeouts == [4.0, 1.0, 10.0]  # /c was never sent
    assert str(e.value) == (
        "PATCH /c not sent: the start-up reconcile gives the apiserver 4s in all, spent"
    )


def test_each_try_of_a_request_gets_its_share_of_the_time_left() -> None:
    """urllib3 gives every retry the whole timeout: the deadline must hold with them."""
    client = _Client(retries=1)
    api = KubeJson(client, request_timeout=10.0)
    with calls_within(4.0, "the start-up reconcile"):
        api.request("GET", "/a")
    assert 1.9 < client.timeouts[0] <= 2.0


def test_the_deadline_is_the_calling_threads_only() -> None:
    client = _Client()
    api = KubeJson(client, request_timeout=10.0)
    with calls_within(0.0, "a spent budget"):
        other = threading.Thread(target=api.request, args=("GET", "/other"))
        other.start()
        other.join()
        with pytest.raises(SharedDeadlineError):
            api.request("GET", "/mine")
    assert client.timeouts == [10.0]


def test_retries_bound_what_one_request_costs(tmp_path: Path) -> None:
    """With retries=1 a request to an apiserver that never answers costs two timeouts, not
    urllib3's default four."""
    import time

    stub = StubApiserver()
    try:
        kubeconfig = str(stub.kubeconfig(tmp_path / "kc"))
        assert load_api_client(kubeconfig).configuration.retries is None  # urllib3's 3
        api = KubeJson(load_api_client(kubeconfig, retries=1), request_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(Exception, match="Read timed out"):
            api.request("GET", "/version")
        took = time.monotonic() - started
    finally:
        stub.close()
    assert len(stub.requests) == 2, stub.requests
    assert took < 1.5 + 1.0, took  # generous: two timeouts of 0.5 s, not four
