"""One node agent per node (issue 45, item B): the checkpoint directory is locked for the whole
life of the plugin process; a second one waits, says why in its log and in a Node event, and
takes over when the first exits, without touching the first one's records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.waiting import wait_for
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.agentlock import (
    LOCK_FILE,
    AgentLock,
    LockWaitStoppedError,
    hold_checkpoint_dir,
)
from kubeletplugin.checkpoint import (
    FILE_NAME,
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    decode,
)
from tests.kubeletplugin.node_harness import mig
from tests.support.plugin_process import DRIVER, PLUGIN, REPO, PluginProcess, free_port


class _Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []
        self.changed = threading.Condition()

    def event(self, *, type_: str, reason: str, message: str, action: str = "GpuHealth") -> None:
        with self.changed:
            self.posted.append((type_, reason, message))
            self.changed.notify_all()


def test_a_second_lock_on_the_directory_fails_until_the_first_is_released(
    tmp_path: Path,
) -> None:
    first, second = AgentLock(tmp_path / "cp"), AgentLock(tmp_path / "cp")
    assert first.try_acquire()
    assert not second.try_acquire()  # flock: per open file, so even within one process
    holder = second.holder()
    assert holder.pid == os.getpid() and holder.since
    first.release()
    assert second.try_acquire()
    assert (tmp_path / "cp" / LOCK_FILE).stat().st_mode & 0o777 == 0o600
    second.release()


def test_the_second_agent_waits_says_why_and_takes_over(tmp_path: Path) -> None:
    first = AgentLock(tmp_path)
    assert first.try_acquire()
    events, stop, got = _Events(), threading.Event(), []
    waiter = threading.Thread(
        target=lambda: got.append(
            hold_checkpoint_dir(tmp_path, stop=stop, events=events, poll_seconds=0.02)
        )
    )
    waiter.start()
    with events.changed:
        assert events.changed.wait_for(lambda: events.posted, timeout=10)
    ((kind, reason, message),) = events.posted
    assert (kind, reason) == ("Warning", "AgentWaitingForLock")
    assert f"pid {os.getpid()}" in message and str(tmp_path / LOCK_FILE) in message
    assert "fuser" in message and "takes over when that one exits" in message
    assert waiter.is_alive() and not got  # still waiting
    first.release()
    waiter.join(timeout=10)
    assert got and got[0].held
    got[0].release()


def test_a_stop_ends_the_wait(tmp_path: Path) -> None:
    first = AgentLock(tmp_path)
    assert first.try_acquire()
    stop = threading.Event()
    stop.set()
    with pytest.raises(LockWaitStoppedError, match="stopped while waiting"):
        hold_checkpoint_dir(tmp_path, stop=stop, poll_seconds=0.01)
    first.release()


# --- two real plugin processes on one node ---------------------------------------------------


class _Api(ThreadingHTTPServer):
    """An apiserver that takes Events and answers everything else 503 (so the plugin keeps every
    record: a read error leaves them alone); records each Event posted."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.events: list[dict[str, Any]] = []


class _Handler(BaseHTTPRequestHandler):
    server: _Api

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def do_POST(self) -> None:
        body = self._body()
        if "/apis/events.k8s.io/v1/" in self.path:
            self.server.events.append(body)
            self._answer(201, body)
            return
        self._unavailable()

    def do_GET(self) -> None:
        self._unavailable()

    def do_PATCH(self) -> None:
        self._body()
        self._unavailable()

    do_PUT = do_DELETE = do_PATCH  # noqa: N815 - http.server's spelling

    def _unavailable(self) -> None:
        self._answer(503, {"kind": "Status", "status": "Failure", "code": 503, "message": "down"})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[_Api, Path]]:
    server = _Api()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kc = tmp_path / "kc"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    kc.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    yield server, kc
    server.shutdown()


def _prepared_claim(root: Path) -> bytes:
    """The node as a first agent left it: one claim prepared, its instance carved; returns the
    checkpoint's bytes. (The sim config is the one PluginProcess writes for `root`.)"""
    sim.configure({"state": str(root / "sim-state.json"), "uuid_seed": str(root),
                   "gpus": ["H100-SXM5-80GB"]})  # fmt: skip
    try:
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            gpu = b.gpus()[0]
            c = b.carve(gpu.uuid, 19, 3)
            device = DeviceRecord(
                mig(b, 0, 19, 3), ("req0",), "node-x", gpu.uuid, 0, 19, 3, 1,
                c.gi_id, c.ci_id, c.mig_uuid, (f"{DRIVER}/claim=u1-x",),
            )  # fmt: skip
            boot = b.boot_id()
    finally:
        sim.configure(None)
    record = ClaimRecord("u1", "default", "c", ClaimState.PREPARE_COMPLETED, (device,), True,
                         boot_id=boot)  # fmt: skip
    store = CheckpointStore(root / "plugins" / DRIVER)
    store.save(Checkpoint(claims={"u1": record}, boot_id=boot))
    return store.path.read_bytes()


def _log_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]


def test_two_real_plugin_processes_one_waits_then_takes_over_with_every_record(
    tmp_path: Path, api: tuple[_Api, Path]
) -> None:
    server, kubeconfig = api
    root = tmp_path  # no deeper: the registration socket's path must fit in 107 bytes
    before = _prepared_claim(root)
    first = PluginProcess(root, "node-x", kubeconfig, gpus=("H100-SXM5-80GB",))
    second: subprocess.Popen[bytes] | None = None
    second_log = root / "second.log"
    try:
        wait_for("the first to run", lambda: "carve kubelet plugin running" in first.logs(), 60)
        with open(second_log, "ab") as out:
            second = subprocess.Popen(
                [PLUGIN, "--node-name", "node-x", "--kubeconfig", str(kubeconfig),
                 "--simulate", str(first.sim_config), "--registry-dir", str(first.registry),
                 "--plugins-dir", str(root / "plugins"), "--cdi-root", str(root / "cdi"),
                 "--http-address", f"127.0.0.1:{free_port()}", "--resync-period", "1s"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
        (waiting,) = wait_for(
            "the second to say it waits",
            lambda: [x for x in _log_lines(second_log) if x["msg"].startswith("waiting for")],
            60,
        )
        assert str(first.proc.pid) in waiting["holder"], waiting
        assert waiting["lock"] == str(root / "plugins" / DRIVER / LOCK_FILE)
        (event,) = wait_for(
            "the Node event",
            lambda: [e for e in server.events if e.get("reason") == "AgentWaitingForLock"],
        )
        assert event["type"] == "Warning" and event["regarding"]["kind"] == "Node"
        assert event["regarding"]["name"] == "node-x"
        assert f"pid {first.proc.pid}" in event["note"]
        assert second.poll() is None  # waiting, not crashed
        assert "carve kubelet plugin running" not in second_log.read_text()
        cp_path = root / "plugins" / DRIVER / FILE_NAME
        assert CheckpointStore(cp_path.parent).load().claims.keys() == {"u1"}

        # the first goes (a rolling update): the second takes over with the record
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=60) == 0
        wait_for(
            "the second to run",
            lambda: "carve kubelet plugin running" in second_log.read_text(),
            60,
        )
        assert any(x["msg"].startswith("checkpoint directory lock taken")
                   for x in _log_lines(second_log))  # fmt: skip
        rec = CheckpointStore(cp_path.parent).load().claims["u1"]
        assert rec.state is ClaimState.PREPARE_COMPLETED
        assert rec.devices == decode(before).claims["u1"].devices  # nothing of it lost
    finally:
        if first.proc.poll() is None:
            first.stop()
        else:
            first.kubelet.close()
            first.log.close()
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=60)
