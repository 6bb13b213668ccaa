"""The shared ops endpoints, over a real socket on 127.0.0.1."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge

from process.opshttp import OpsServer


def _broken() -> str:
    raise RuntimeError("boom")


@pytest.fixture
def state() -> dict[str, str]:
    return {"sync": "not synced yet"}


@pytest.fixture
def base(state: dict[str, str]) -> Iterator[str]:
    registry = CollectorRegistry()
    Gauge("carve_test_value", "a value", registry=registry).set(7)
    server = OpsServer("127.0.0.1:0", registry, {"sync": lambda: state["sync"]})
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_metrics_ignore_query_string_and_use_the_exposition_content_type(base: str) -> None:
    code, ctype, body = _get(f"{base}/metrics?name[]=carve_test_value")
    assert code == 200 and ctype == CONTENT_TYPE_LATEST
    assert "carve_test_value 7.0" in body
    assert _get(f"{base}/nope")[0] == 404


def test_readyz_names_each_failing_check(base: str, state: dict[str, str]) -> None:
    code, _, body = _get(f"{base}/readyz")
    assert code == 503 and "[-]sync not synced yet" in body
    state["sync"] = ""
    code, _, body = _get(f"{base}/readyz?verbose")
    assert code == 200 and body.endswith("readyz check passed\n")
    code, _, body = _get(f"{base}/healthz")
    assert (code, body) == (200, "ok\n")


def test_a_raising_check_reads_as_not_ready() -> None:
    server = OpsServer("127.0.0.1:0", CollectorRegistry(), {"api": _broken})
    server.start()
    try:
        assert server.readiness() == {"api": "check failed: boom"}
    finally:
        server.stop()


def test_stop_without_start_returns() -> None:
    """A component whose start-up fails after binding the ops port must still shut down."""
    import threading

    from prometheus_client import CollectorRegistry

    from process.opshttp import OpsServer

    server = OpsServer("127.0.0.1:0", CollectorRegistry(), {})
    stopper = threading.Thread(target=server.stop, daemon=True)
    stopper.start()
    stopper.join(timeout=5)
    assert not stopper.is_alive()


def test_a_report_is_shown_but_does_not_fail_readiness(state: dict[str, str]) -> None:
    """A lost GPU is said in /readyz, yet the agent serving the node's others stays ready."""
    report = {"gpus": "GPU index 0 is lost (XID 79)"}
    server = OpsServer("127.0.0.1:0", CollectorRegistry(), {"sync": lambda: ""},
                       reports={"gpus": lambda: report["gpus"]})  # fmt: skip
    server.start()
    try:
        code, _, body = _get(f"http://127.0.0.1:{server.port}/readyz")
        assert code == 200, body
        assert body == "[+]sync ok\n[!]gpus GPU index 0 is lost (XID 79)\nreadyz check passed\n"
        report["gpus"] = ""
        assert _get(f"http://127.0.0.1:{server.port}/readyz")[2].splitlines()[1] == "[+]gpus ok"
    finally:
        server.stop()


def test_checks_handed_over_after_start_replace_the_start_up_check() -> None:
    """A process serves /healthz before it is assembled, then its full set of checks."""
    server = OpsServer("127.0.0.1:0", CollectorRegistry(), {"startup": lambda: "opening NVML"})
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert _get(f"{base}/healthz")[0] == 200
        assert _get(f"{base}/readyz")[::2] == (503, "[-]startup opening NVML\n")
        server.set_checks({"startup": lambda: "", "api": lambda: "apiserver unreachable"})
        assert _get(f"{base}/readyz")[::2] == (503, "[+]startup ok\n[-]api apiserver unreachable\n")
    finally:
        server.stop()


def test_healthz_fails_while_a_liveness_check_says_the_work_is_stuck() -> None:
    """The controller's decision loop (issue 41.6): a wedged loop must not look alive."""
    stuck = {"decisions": ""}
    server = OpsServer("127.0.0.1:0", CollectorRegistry(), {},
                       liveness={"decisions": lambda: stuck["decisions"]})  # fmt: skip
    server.start()
    try:
        assert _get(f"http://127.0.0.1:{server.port}/healthz")[::2] == (200, "ok\n")
        stuck["decisions"] = "no progress for 61s"
        code, _, body = _get(f"http://127.0.0.1:{server.port}/healthz")
        assert (code, body) == (503, "[-]decisions no progress for 61s\n")
        stuck["decisions"] = ""
        assert _get(f"http://127.0.0.1:{server.port}/healthz")[0] == 200
    finally:
        server.stop()
