"""A burst of pods, on the carve path and on the native path, and what each pod cost.

The carve path: pods whose claims use carve's DeviceClass are gated by carve's admission
policy, placed by carve-controller and bound by kube-scheduler. The native path: the same pods
with claims of a DeviceClass that is not carve's but selects the same partitionable devices
(`NATIVE_CLASS`), so no gate: kube-scheduler allocates and binds alone, and
kube-controller-manager releases. Both are measured on the same fleet in the same session.

One burst is two windows, so that what a placement costs and what a release costs are counted
apart (the controller's writes for the two are the same verbs on the same resources):
- placement: from creating every pod at once until the last is bound and nothing more is
  sent (`CostMeter.settled`: the events written beside the decision thread are in);
- release: from deleting them all until every pod and claim is gone and nothing more is sent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from driver.contract import DEFAULT_CONTRACT
from tests.support.scale_cost import (
    APISERVER,
    CONTROLLER,
    CONTROLLER_MANAGER,
    ETCD,
    SCHEDULER,
    Cost,
    CostMeter,
    diff,
)
from tests.support.scale_pods import PROFILES, PodTracker, pod_manifest

NATIVE_CLASS = "scale-native"
"""A DeviceClass that is not carve's (no gate, carve leaves its claims alone) and selects
carve's MIG devices: kube-scheduler allocates them as it would any partitionable device."""
BURST_LABEL = "scale.carve.dev/burst"


def native_class() -> dict[str, Any]:
    # The MIG devices carve's own class selects (not the whole-GPU ones, which have no
    # profile attribute for the templates' selectors to read).
    driver = DEFAULT_CONTRACT.driver
    expression = f'device.driver == "{driver}" && device.attributes["{driver}"].type == "mig"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": NATIVE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


@dataclass(frozen=True)
class BurstFigures:
    arm: str  # a controller's label, or "native"
    nodes: int
    pods: int
    bound: int
    to_last_bound_s: float  # from the first create to the last pod bound
    placing: Cost
    released: int
    release_s: float
    releasing: Cost

    def cpu_ms_per_pod(self, component: str, *, release: bool = False) -> float:
        cost = self.releasing if release else self.placing
        done = self.released if release else self.bound
        return cost.cpu.get(component, math.nan) * 1000 / done if done else math.nan

    @property
    def control_plane_ms_per_pod(self) -> float:
        """Every control-plane component's CPU for one pod, placed and released."""
        if not self.bound:
            return math.nan
        total = self.placing.control_plane_cpu + self.releasing.control_plane_cpu
        return total * 1000 / self.bound

    @property
    def requests_per_placement(self) -> float:
        """The controller's requests (its own counter) per pod placed."""
        return self.placing.carve_requests / self.bound if self.bound else math.nan

    @property
    def requests_per_release(self) -> float:
        return self.releasing.carve_requests / self.released if self.released else math.nan

    def sent_per_pod(self, component: str) -> float:
        """Requests per pod that `component` sent (APF), placement and release together."""
        if not self.bound:
            return math.nan
        sent = self.placing.sent.get(component, 0.0) + self.releasing.sent.get(component, 0.0)
        return sent / self.bound

    def describe(self) -> str:
        parts = [
            f"[{self.arm} burst @ {self.nodes} nodes] {self.bound}/{self.pods} bound, "
            f"last {self.to_last_bound_s:.1f}s after the first create; "
            f"{self.released} released in {self.release_s:.1f}s",
            "  CPU ms per pod (placing + releasing): "
            + ", ".join(
                f"{c} {self.cpu_ms_per_pod(c):.2f} + {self.cpu_ms_per_pod(c, release=True):.2f}"
                for c in (CONTROLLER, SCHEDULER, CONTROLLER_MANAGER, APISERVER, ETCD)
                if c in self.placing.cpu
            )
            + f"; control plane {self.control_plane_ms_per_pod:.2f}",
            "  requests per pod (APF): "
            + ", ".join(
                f"{c} {self.sent_per_pod(c):.2f}"
                for c in (CONTROLLER, SCHEDULER, CONTROLLER_MANAGER)
                if c in self.placing.sent
            ),
        ]
        if self.placing.carve:
            parts.append(
                f"  carve-controller: {self.requests_per_placement:.2f} requests per placement "
                f"({self.placing.carve_by_request()}), {self.requests_per_release:.2f} per "
                f"release ({self.releasing.carve_by_request()})"
            )
        return "\n".join(parts)


@dataclass(frozen=True)
class BurstRun:
    """What a burst needs of the benchmark around it."""

    api: Any  # tests.support KubeJson, admin
    namespace: str
    meter: CostMeter
    tracker: PodTracker
    creators: int
    timeout_s: float
    controller_pid: int | None = None
    controller_text: Callable[[], str] | None = None
    alive: Callable[[], bool] = lambda: True


def run_burst(
    run: BurstRun, arm: str, nodes: int, count: int, template_prefix: str
) -> BurstFigures:
    """`count` pods created at once (`template_prefix` + profile names their template), every
    one waited for until bound, then all deleted and waited for until their claims are gone."""
    names = [f"burst-{arm}-{i:05d}" for i in range(count)]
    pods = f"/api/v1/namespaces/{run.namespace}/pods"
    s0 = run.meter.sample(run.controller_pid, run.controller_text)
    begin = time.monotonic()

    def create(i: int) -> None:
        body = pod_manifest(names[i], PROFILES[i % len(PROFILES)], template_prefix)
        body["metadata"]["labels"] = {BURST_LABEL: arm}
        run.api.request("POST", pods, body=body)
        run.tracker.created(names[i], time.monotonic())

    with ThreadPoolExecutor(run.creators) as pool:
        list(pool.map(create, range(count)))

    def all_bound() -> bool:
        snap = run.tracker.snapshot()
        return all(n in snap and not math.isnan(snap[n].bound) for n in names)

    _wait_until(run, all_bound, f"the {arm} burst's pods to be bound")
    snap = run.tracker.snapshot()
    bound = [snap[n].bound for n in names if n in snap and not math.isnan(snap[n].bound)]
    s1 = run.meter.settled(run.controller_pid, run.controller_text)
    release_begin = time.monotonic()
    run.api.request(
        "DELETE",
        pods,
        query=[("labelSelector", f"{BURST_LABEL}={arm}"), ("gracePeriodSeconds", "0")],
        body={},
    )
    claims = f"/apis/resource.k8s.io/v1/namespaces/{run.namespace}/resourceclaims"
    gone = _wait_until(
        run,
        lambda: (
            not run.api.request("GET", pods, query=[("limit", "1")]).get("items")
            and not run.api.request("GET", claims, query=[("limit", "1")]).get("items")
        ),
        f"the {arm} burst's pods and claims to be gone",
    )
    release_s = time.monotonic() - release_begin
    s2 = run.meter.settled(run.controller_pid, run.controller_text)
    return BurstFigures(
        arm=arm,
        nodes=nodes,
        pods=count,
        bound=len(bound),
        to_last_bound_s=(max(bound) - begin) if bound else math.nan,
        placing=diff(s0, s1),
        released=len(bound) if gone else 0,
        release_s=release_s,
        releasing=diff(s1, s2),
    )


def _wait_until(run: BurstRun, done: Callable[[], bool], what: str) -> bool:
    deadline = time.monotonic() + run.timeout_s
    while not done():
        if not run.alive():
            raise RuntimeError(f"carve-controller exited waiting for {what}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def summary_line(nodes: int, carve: BurstFigures, native: BurstFigures, peak_rss_mb: float) -> str:
    """The line `bench.scale` ends each node count with, for a script to read (issue 29)."""

    def ratio(a: float, b: float) -> float:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan

    figures = {
        "requests_per_placement": carve.requests_per_placement,
        "requests_per_release": carve.requests_per_release,
        "controller_cpu_per_placement_ms": carve.cpu_ms_per_pod(CONTROLLER),
        "scheduler_cpu_per_pod_ms": native.cpu_ms_per_pod(SCHEDULER),
        "controlplane_cpu_ratio": ratio(
            carve.control_plane_ms_per_pod, native.control_plane_ms_per_pod
        ),
        "burst_ratio": ratio(carve.to_last_bound_s, native.to_last_bound_s),
        "peak_rss_mb": peak_rss_mb,
    }
    return f"nodes={nodes} " + " ".join(f"{k}={v:.2f}" for k, v in figures.items())
