"""Writes whose answer was lost (issue 30.1): the placement stays held until a fresh read.

The Kubernetes client raises urllib3's errors for a connection reset or a read timeout; those
must be retried (the retry carries the resourceVersion, so a write that landed is found by
the 409's fresh read), and a commit that still fails must not free a placement the apiserver
may hold. `tests/controller/cluster/test_faults_cluster.py` shows the same through a real
proxy that drops an allocation's response.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3.exceptions

from controller.leader import LeaderElector, LeaseConfig
from controller.objects import ClaimAllocation, Kind
from controller.status import KubeClaimWriter
from controller.writepool import WritePool
from driver.apiobject import Obj
from process.kube.jsonclient import KubeJson
from process.kube.rmw import RetryPolicy, Target, is_transient, read_modify_write
from process.kubeconfig import load_api_client
from tests.support.engine_cluster import node
from tests.support.reconciler import Harness, HeldWrites, MemoryWriter, claim, pod

_RESET = urllib3.exceptions.ProtocolError(
    "Connection aborted.", ConnectionResetError(104, "Connection reset by peer")
)


@pytest.mark.parametrize(
    "error",
    [
        _RESET,
        urllib3.exceptions.ReadTimeoutError(None, "/", "Read timed out. (read timeout=5)"),  # type: ignore[arg-type]
        urllib3.exceptions.MaxRetryError(None, "/", _RESET),  # type: ignore[arg-type]
        urllib3.exceptions.NewConnectionError(None, "connection refused"),  # type: ignore[arg-type]
        ConnectionResetError(104, "reset"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_the_clients_link_errors_are_transient(error: Exception) -> None:
    assert is_transient(error)


def test_a_url_mistake_is_not_retried() -> None:
    assert not is_transient(urllib3.exceptions.LocationParseError("::bad"))


def test_a_write_whose_answer_was_lost_is_found_landed_by_the_retry() -> None:
    """The PATCH lands, its answer is lost; the retry's stale resourceVersion gets 409, the
    fresh read shows the change made, and nothing is written twice."""
    obj: Obj = {"metadata": {"name": "c", "uid": "u", "resourceVersion": "1"}, "data": []}
    writes: list[Obj] = []

    def write(body: Obj) -> Obj:
        writes.append(body)
        if body["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise _StatusError(409)
        obj["data"] = body["data"]
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        if len(writes) == 1:
            raise _RESET  # applied, and the answer never came
        return copy.deepcopy(obj)

    def mutate(cur: Obj) -> Obj | None:
        return None if "x" in cur["data"] else {"data": [*cur["data"], "x"]}

    target = Target("ns", "c", "u", lambda: copy.deepcopy(obj), write)
    got = read_modify_write(
        target,
        mutate,
        current=copy.deepcopy(obj),
        policy=RetryPolicy(attempts=4),
        sleep=lambda _s: None,
    )
    assert got["data"] == ["x"]
    assert len(writes) == 2  # the first landed; the second was refused (409), then nothing


class _StatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _LandsThenLosesAnswer(MemoryWriter):
    """The allocation is applied, then the connection drops before the answer: what a
    controller sees when the apiserver committed the write and the link failed."""

    def __init__(self) -> None:
        super().__init__()
        self.lose: set[str] = set()

    def write_allocation(self, claim_obj: Obj, allocation: ClaimAllocation, classes: Any) -> Obj:
        written = super().write_allocation(claim_obj, allocation, classes)
        if claim_obj["metadata"]["name"] in self.lose:
            self.lose.discard(claim_obj["metadata"]["name"])
            raise _RESET
        return written


def _harness(beside: HeldWrites | None, writer: MemoryWriter) -> Harness:
    h = Harness(nodes={"n1": 1}, commit_beside=beside.offer if beside else None, writer=writer)
    h.add(Kind.NODE, node("n1"))
    return h


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "inline"])
def test_a_lost_answer_never_frees_a_placement_the_apiserver_holds(beside: bool) -> None:
    writer = _LandsThenLosesAnswer()
    held = HeldWrites() if beside else None
    h = _harness(held, writer)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    writer.lose.add("c")
    h.step()
    if held is not None:
        held.run_all()  # the commit fails: its allocation landed, its answer did not
        h.step()
    # No watch event has come (the informer is slow): a like pod arrives while p backs off.
    h.add(Kind.CLAIM, claim("d"))
    h.add(Kind.POD, pod("q", ["d"], created="2026-01-02T00:00:00Z"))
    for advance in (0, 60, 60):
        h.now[0] += advance
        h.step()
        if held is not None:
            held.run_all()  # the fresh read, and any later commit
            h.step()
    devices = h.allocated_devices()
    assert devices == [("n1", "dev-0")], devices  # c holds it; d was never given it
    assert writer.reads == ["c"]
    assert h.planner.used() == {("n1", "dev-0")}


def test_a_placement_stays_held_while_the_settling_read_fails() -> None:
    writer = _LandsThenLosesAnswer()
    held = HeldWrites()
    h = _harness(held, writer)
    h.add(Kind.CLAIM, claim("c"))
    h.add(Kind.POD, pod("p", ["c"]))
    writer.lose.add("c")
    h.step()
    held.run_all()
    h.step()
    # The apiserver is unreachable: the read fails, is tried again after a wait.
    writer.fail[("read_claim", "c")] = ConnectionRefusedError(111, "refused")
    held.run_all()
    h.step()
    assert h.planner.used() == {("n1", "dev-0")}
    h.step()
    assert held.held == []  # not read again before its wait
    # Meanwhile someone else cleared the allocation: the fresh read (once due) shows it
    # free, and only then is the placement free again (p, past its backoff, takes it).
    cur = h.current("c")
    cur["status"] = {}
    writer.put(cur)
    h.now[0] += 1.5
    h.step()
    assert [k for k, _ in held.held] == ["ns/c"]
    held.run_all()
    assert h.planner.committed_pods == []
    h.step()
    assert writer.reads == ["c", "c"]
    assert [k for k, _ in held.held] == ["ns/p"]  # placed again, on the freed device


# -- client timeouts ----------------------------------------------------------------------------


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An apiserver address that accepts connections and never answers (a half-open peer)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


def _kubeconfig(tmp_path: Any, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return str(path)


def _finishes_within(seconds: float, call: Any) -> bool:
    done = threading.Event()

    def run() -> None:
        try:
            call()
        except Exception:
            pass
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)


def test_a_commit_write_on_a_half_open_connection_times_out(black_hole: str, tmp_path: Any) -> None:
    api = load_api_client(_kubeconfig(tmp_path, black_hole))
    writer = KubeClaimWriter(KubeJson(api, request_timeout=0.3), attempts=2)
    c = claim("c")
    started = time.monotonic()
    assert _finishes_within(10, lambda: writer.add_finalizer(c))
    assert time.monotonic() - started < 10


def test_the_lease_renewal_on_a_half_open_connection_times_out(
    black_hole: str, tmp_path: Any
) -> None:
    api = load_api_client(_kubeconfig(tmp_path, black_hole), request_timeout=60)
    cfg = LeaseConfig(lease_duration_s=3, renew_deadline_s=1, retry_period_s=0.5)
    elector = LeaderElector(KubeJson(api, request_timeout=60), cfg)  # each renewal: 1 s
    assert _finishes_within(8, elector.try_acquire_or_renew)
    assert not elector.is_leader()


def test_a_list_on_a_half_open_connection_times_out(black_hole: str, tmp_path: Any) -> None:
    """The informers' lists go through the JSON client, which times every request."""
    kube = KubeJson(load_api_client(_kubeconfig(tmp_path, black_hole)), request_timeout=0.3)
    nodes = [("limit", "10")]
    assert _finishes_within(10, lambda: kube.request("GET", "/api/v1/nodes", query=nodes))


def test_commit_workers_never_block_on_a_stalled_apiserver(black_hole: str, tmp_path: Any) -> None:
    """With a timeout a stalled write ends, so a worker (and a hand-over draining it) is free."""
    api = load_api_client(_kubeconfig(tmp_path, black_hole))
    writer = KubeClaimWriter(KubeJson(api, request_timeout=0.3), attempts=2)
    pool = WritePool(workers=1)
    pool.offer("k", lambda: writer.add_finalizer(claim("c")))
    assert pool.drain(deadline=time.monotonic() + 10)
