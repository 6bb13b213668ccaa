"""Start-up fits the kubelet's probes, and ready means "this agent serves" (issue 45, 5 and 6).

The real carve-kubelet-plugin process against a stand-in apiserver that holds every request
without answering (tests/support/stub_apiserver.py) until the test lets it answer. Before,
recovery and one claim read per prepared claim ran before /healthz existed, each read costing
four client timeouts (40 s), so the kubelet's liveness probe killed the agent before it served;
and a lost GPU made /readyz fail although the agent served the node's other GPUs.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.waiting import wait_for
from driver.nvml import sim
from kubeletplugin.checkpoint import CheckpointStore
from tests.support.plugin_process import DRIVER, PluginProcess, seed_checkpoint
from tests.support.stub_apiserver import StubApiserver

# Generous bounds, far from what the old order took (>= 40 s before /healthz with a prepared
# claim and an apiserver that does not answer): they prove the order, not a speed.
HEALTHZ_WITHIN = 10.0
REGISTERED_WITHIN = 45.0


def _get(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:  # /readyz may wait 2 x 4 s
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


def _wait_ready(p: PluginProcess, timeout: float) -> str:
    """/readyz once it passes, the kubelet stand-in registering the plugin meanwhile; on a
    timeout the failure quotes the last answer."""
    last: list[tuple[int | None, str]] = [(None, "")]

    def ready() -> str | None:
        p.kubelet.scan()
        last[0] = _get(p.url("/readyz"))
        return last[0][1] if last[0][0] == 200 else None

    try:
        return wait_for("/readyz passing", ready, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last /readyz: {last[0]}") from None


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    s = StubApiserver()
    yield s
    s.close()


def test_healthz_answers_and_the_kubelet_registers_while_the_apiserver_does_not_answer(
    tmp_path: Path, stub: StubApiserver
) -> None:
    p = PluginProcess(
        tmp_path, "node-s", stub.kubeconfig(tmp_path / "kc"), "--no-publish", run=False
    )
    uids = seed_checkpoint(p, prepared=2, interrupted=1)
    started = time.monotonic()
    p.start()
    try:
        wait_for(
            "/healthz", lambda: _get(p.url("/healthz")) == (200, "ok\n"), timeout=HEALTHZ_WITHIN
        )
        healthz_after = time.monotonic() - started
        code, body = _get(p.url("/readyz"))
        assert code == 503 and "[-]startup start-up is " in body, body
        print(f"/healthz after {healthz_after:.1f}s; /readyz: {body.splitlines()[0]}")

        # Registration waits for the reconcile with NVML, not for the apiserver.
        wait_for("registration", lambda: p.kubelet.scan() or p.kubelet.plugins.get(DRIVER),
                 timeout=REGISTERED_WITHIN)  # fmt: skip
        print(f"registered after {time.monotonic() - started:.1f}s")
        assert stub.requests, "the reconcile did not try the apiserver at all"
        code, body = _get(p.url("/readyz"))
        assert code == 503 and "[-]startup start-up is waiting for the apiserver" in body, body
        assert "to check 3 checkpointed claim(s) against it" in body, body

        stub.answer()  # the apiserver recovers: start-up ends, the vanished claims are released
        body = _wait_ready(p, 90)
        assert "[+]startup ok" in body and body.endswith("readyz check passed\n"), body
        print(f"ready after {time.monotonic() - started:.1f}s")
        assert p.logs().count("releasing claim that no longer exists in the API") == 2
        left = CheckpointStore(tmp_path / "plugins" / DRIVER).load().claims
        assert not set(uids) & set(left), left
    finally:
        rc = p.stop()
    assert rc == 0, p.logs()[-3000:]


def test_sigterm_while_waiting_for_the_apiserver_stops_at_once(
    tmp_path: Path, stub: StubApiserver
) -> None:
    """A wait for the apiserver is no step to finish: SIGTERM ends it, the agent exits 0."""
    p = PluginProcess(
        tmp_path, "node-t", stub.kubeconfig(tmp_path / "kc"), "--no-publish", run=False
    )
    seed_checkpoint(p, prepared=1)
    p.start()
    try:
        wait_for(
            "start-up waiting for the apiserver",
            lambda: "waiting for the apiserver" in _get(p.url("/readyz"))[1],
            timeout=REGISTERED_WITHIN,
        )
        asked = time.monotonic()
        rc = p.stop()
        took = time.monotonic() - asked
    finally:
        if p.proc.poll() is None:  # a failure above, or a stop that did not end it
            p.proc.kill()
            p.proc.wait()
    assert rc == 0, p.logs()[-3000:]
    assert took < 20, p.logs()[-3000:]
    assert "stopped" in p.logs()


def test_a_lost_gpu_is_reported_in_readyz_without_failing_it(tmp_path: Path) -> None:
    stub = StubApiserver(answering=True)
    p = PluginProcess(
        tmp_path, "node-g", stub.kubeconfig(tmp_path / "kc"), "--no-publish", run=False
    )
    sim.configure(p.sim_config)
    try:
        sim.sim_lose_gpu(0)  # fallen off the bus before the plugin started
    finally:
        sim.configure(None)
    p.start()
    try:
        body = _wait_ready(p, REGISTERED_WITHIN)
        print(body)
        assert "[!]gpus GPU index 0 is lost (" in body and "[-]" not in body, body
        assert body.endswith("readyz check passed\n"), body
        metrics = wait_for(
            "carve_lost_gpus",
            lambda: 'carve_lost_gpus{gpu="0"} 1.0' in (m := _get(p.url("/metrics"))[1]) and m,
        )
        assert metrics
        assert any(r.startswith("POST /apis/events.k8s.io/v1/") for r in stub.requests)
    finally:
        rc = p.stop()
        stub.close()
    assert rc == 0, p.logs()[-3000:]
