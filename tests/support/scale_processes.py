"""The scale benchmark's processes and endpoints: the carve-controller under test (its own
user, metrics port, source tree and CPUs), /proc readings and kube-apiserver's metrics."""

from __future__ import annotations

import math
import os
import socket
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from driver.contract import DEFAULT_CONTRACT
from tests.support import promtext
from tests.support.scale_cost import cpu_s

_T = TypeVar("_T")

CONTROLLER_USER = "carve-scale-controller"
FLOW_SCHEMA = CONTROLLER_USER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    """Resident set size from /proc (what the kernel charges the process)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def apiserver_metrics(api_client: Any) -> str:
    method, url, headers, body, _ = api_client.param_serialize(
        method="GET",
        resource_path="/metrics",
        header_params={"Accept": "text/plain"},
        auth_settings=["BearerToken"],
    )
    resp = api_client.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
    data = resp.read() or b""
    return data.decode() if isinstance(data, bytes) else str(data)


def controller_requests(apiserver_text: str) -> float:
    return promtext.counter_sum(
        apiserver_text, "apiserver_flowcontrol_dispatched_requests_total", flow_schema=FLOW_SCHEMA
    )


def started_on_cpus(cpus: frozenset[int], start: Callable[[], _T]) -> _T:
    """Run `start` (which forks a process) with this thread bound to `cpus`, so the child and
    every thread it makes inherit them; this thread gets its own CPUs back afterwards. Binding
    the child after it started would miss the threads it made meanwhile."""
    if not cpus:
        return start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return start()
    finally:
        os.sched_setaffinity(0, before)


class ControllerUnderTest:
    """One carve-controller process as the benchmark runs it: its own user (so the apiserver
    can count its requests), its metrics port, optionally another source tree's code, and
    optionally CPUs of its own."""

    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        source: Path | None,
        cpus: frozenset[int] = frozenset(),
        extra: Sequence[str] = (),
    ) -> None:
        """`extra`: more flags for the controller (e.g. `--packing-policy=least-waste`)."""
        from devcluster.processes import ManagedProcess, console_script

        self.port = free_port()
        env = dict(os.environ)
        if source is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(source), env.get("PYTHONPATH", "")) if p
            )
        argv = [
            *console_script("carve-controller", "controller.main"),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            f"--http-address=127.0.0.1:{self.port}",
            "--log-format=text",
            f"--driver-name={DEFAULT_CONTRACT.driver}",
            *extra,
        ]
        self.started = time.monotonic()
        self.process = started_on_cpus(
            cpus,
            lambda: ManagedProcess("carve-controller", argv, log, tie_to_parent=True, env=env),
        )

    def metrics(self) -> str:
        return _http_text(f"http://127.0.0.1:{self.port}/metrics")

    def ready(self) -> bool:
        return _ready(f"http://127.0.0.1:{self.port}/readyz")

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def cpu_s(self) -> float:
        return cpu_s(self.process.pid)

    def alive(self) -> bool:
        return self.process.exit_code() is None

    def stop(self) -> None:
        self.process.stop(grace_seconds=10.0)
