"""What a window of the scale benchmark cost each control-plane component: CPU time from
/proc, the requests each one sent (kube-apiserver's API Priority and Fairness counter, per
FlowSchema: one per component), and the controller's own request counter
(`carve_api_requests_total`) by verb and resource.

A window is two `CostSample`s; `Cost` is their difference. The windows of `bench.scale` end
only when what they started has settled (`settled`): the writes a placement or a release
makes beside the decision thread (events, releases) land after the pod is bound or deleted,
and a window that closed at the last placement missed them."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import promtext

CONTROLLER = "carve-controller"
SCHEDULER = "kube-scheduler"
APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
ETCD = "etcd"
CONTROL_PLANE = (CONTROLLER, SCHEDULER, CONTROLLER_MANAGER, APISERVER, ETCD)
"""Whose CPU a pod costs. The benchmark's own processes (pod creators, the fleet's Lease
renewals) are not the control plane and are left out."""

# Who sent a request, by the FlowSchema kube-apiserver classified it under.
FLOW_SCHEMAS = {
    SCHEDULER: ("kube-scheduler",),
    # Its controllers' own service accounts when it runs with --use-service-account-credentials.
    CONTROLLER_MANAGER: ("kube-controller-manager", "kube-system-service-accounts"),
}
_DISPATCHED = "apiserver_flowcontrol_dispatched_requests_total"


def cpu_s(pid: int) -> float:
    """CPU time the process has used so far (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CostSample:
    """Counters at one moment."""

    at: float
    cpu: Mapping[str, float]  # component -> CPU seconds so far
    sent: Mapping[str, float]  # component -> requests the apiserver dispatched for it
    carve: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (verb, resource)


@dataclass(frozen=True)
class Cost:
    """What happened between two samples."""

    seconds: float
    cpu: Mapping[str, float]
    sent: Mapping[str, float]
    carve: Mapping[tuple[str, str], float]

    @property
    def carve_requests(self) -> float:
        return sum(self.carve.values())

    @property
    def control_plane_cpu(self) -> float:
        return sum(self.cpu.get(c, 0.0) for c in CONTROL_PLANE)

    def carve_by_request(self) -> str:
        """The controller's requests by verb and resource, most first: `patch pods 1000, ...`."""
        rows = sorted(self.carve.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{v} {r} {n:.0f}" for (v, r), n in rows if n) or "none"


def diff(a: CostSample, b: CostSample) -> Cost:
    def sub(x: Mapping[str, float], y: Mapping[str, float]) -> dict[str, float]:
        return {k: y[k] - x.get(k, 0.0) for k in y}

    carve = {k: v - a.carve.get(k, 0.0) for k, v in b.carve.items()}
    return Cost(b.at - a.at, sub(a.cpu, b.cpu), sub(a.sent, b.sent), carve)


def carve_requests(controller_text: str) -> dict[tuple[str, str], float]:
    """`carve_api_requests_total` by (verb, resource), every outcome together."""
    out: dict[tuple[str, str], float] = {}
    for s in promtext.samples(controller_text, "carve_api_requests_total"):
        key = (s.labels.get("verb", ""), s.labels.get("resource", ""))
        out[key] = out.get(key, 0.0) + s.value
    return out


def dispatched(apiserver_text: str, flow_schemas: tuple[str, ...]) -> float:
    return sum(
        promtext.counter_sum(apiserver_text, _DISPATCHED, flow_schema=fs) for fs in flow_schemas
    )


class CostMeter:
    """Takes samples of the control plane's processes, the apiserver and the controller."""

    def __init__(
        self,
        pids: Mapping[str, int],
        apiserver_text: Callable[[], str],
        controller_flow_schema: str,
    ) -> None:
        self._pids = dict(pids)
        self._apiserver = apiserver_text
        self._schemas = {**FLOW_SCHEMAS, CONTROLLER: (controller_flow_schema,)}

    def sample(
        self, controller_pid: int | None, controller_text: Callable[[], str] | None
    ) -> CostSample:
        pids = dict(self._pids)
        if controller_pid is not None:
            pids[CONTROLLER] = controller_pid
        cpu = {name: _cpu_or_nan(pid) for name, pid in pids.items()}
        text = self._apiserver()
        sent = {name: dispatched(text, fs) for name, fs in self._schemas.items()}
        carve = carve_requests(controller_text()) if controller_text is not None else {}
        return CostSample(time.monotonic(), cpu, sent, carve)

    def settled(
        self,
        controller_pid: int | None,
        controller_text: Callable[[], str] | None,
        quiet_s: float = 2.0,
        timeout_s: float = 30.0,
    ) -> CostSample:
        """A sample taken once no component has sent a request for `quiet_s` (the writes
        beside the decision thread have landed), or after `timeout_s`."""
        last = self.sample(controller_pid, controller_text)
        quiet_since = last.at
        deadline = last.at + timeout_s
        while True:
            time.sleep(0.5)
            now = self.sample(controller_pid, controller_text)
            moved = _total(now) != _total(last)
            if moved:
                quiet_since = now.at
            last = now
            if now.at - quiet_since >= quiet_s or now.at >= deadline:
                return now


def _total(s: CostSample) -> float:
    return sum(s.sent.values()) + sum(s.carve.values())


def _cpu_or_nan(pid: int) -> float:
    try:
        return cpu_s(pid)
    except (OSError, IndexError, ValueError):
        return math.nan


def component_pids(processes: object) -> dict[str, int]:
    """The control plane's pids from devcluster's process records (name, pid)."""
    out: dict[str, int] = {}
    for record in processes:  # type: ignore[attr-defined]
        name = str(getattr(record, "name", ""))
        if name in CONTROL_PLANE:
            out[name] = int(getattr(record, "pid"))  # noqa: B009
    return out
