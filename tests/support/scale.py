"""The scale benchmark's machinery (`python -m bench.scale` is the command line, and the
figures it prints are explained there): a fake GPU fleet (`tests.support.gpufleet`), one
carve-controller process at a time against it, pod churn and the figures of one run.

It lives here, not in bench/, so that tests/bench/test_scale.py can run it on a small fleet
(tests never import bench/)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from driver.contract import DEFAULT_CONTRACT
from tests.support import promtext
from tests.support.gpufleet import GpuFleet
from tests.support.scale_burst import (
    NATIVE_CLASS,
    BurstFigures,
    BurstRun,
    native_class,
    run_burst,
)
from tests.support.scale_cost import CostMeter, carve_requests, component_pids
from tests.support.scale_pods import (
    NATIVE_TEMPLATES,
    PROFILES,
    PodTracker,
    claim_template,
    pod_manifest,
)
from tests.support.scale_processes import (
    CONTROLLER_USER,
    FLOW_SCHEMA,
    ControllerUnderTest,
    apiserver_metrics,
    controller_requests,
)

_T = TypeVar("_T")

NAMESPACE = "scale"
PLAIN_NAMESPACE = "plain"


@dataclass(frozen=True)
class ScaleConfig:
    node_counts: tuple[int, ...] = (100, 300, 1000)
    rate: float = 200.0
    duration_s: float = 30.0
    hold_s: float = 10.0
    drain_s: float = 90.0
    creators: int = 4
    gpus_per_node: int = 8
    plain_pods_per_node: int = 0  # pods of other workloads bound to every node
    # Pods created (and their claims generated) before the controller starts: the rate at
    # which it places a queue that is already there is its own, not the pod creators'.
    backlog: int = 0
    # (label, source tree whose controller/ runs; None: this tree), run in this order per size.
    controllers: tuple[tuple[str, Path | None], ...] = (("this", None),)
    # CPUs the controller process runs on (empty: wherever the kernel puts it). The bench
    # gives the rest of the machine to everything else, so the controller has them alone.
    controller_cpus: frozenset[int] = frozenset()
    # Pods created at once, placed and released on the carve path (per controller) and on the
    # native path (once per size, no controller running): tests.support.scale_burst. 0: none.
    burst: int = 0
    burst_creators: int = 16


@dataclass(frozen=True)
class ScaleFigures:
    controller: str
    nodes: int
    gpus: int
    slices: int
    ready_s: float
    model_s: float
    rss_start_mb: float
    rss_peak_mb: float
    created: int
    placed: int
    bound: int
    churn_s: float
    placed_in_churn: int
    bound_in_churn: int
    run_s: float  # first create to last placement
    decisions: int
    decision_p50_ms: float
    decision_p99_ms: float
    requests: float  # the controller's own count (carve_api_requests_total) over the churn
    requests_per_pod: float  # ... per pod churned, placed and released
    bound_off_fleet: int = 0  # pods bound to a node that is not a fleet node (a bench bug)
    left_behind: bool = False  # pods or claims still there after the clean-up wait
    backlog: int = 0  # pods waiting, claims generated, when the controller started
    backlog_placed: int = 0
    backlog_s: float = math.nan  # first to last placement of the backlog
    # The controller's CPU time per placement while it placed the backlog.
    backlog_cpu_ms: float = math.nan
    # carve_decision_cpu_seconds: the deciding thread's CPU time; NaN for a controller that
    # does not export it (an older tree under --compare).
    decision_cpu_p99_ms: float = math.nan
    apf_requests: float = math.nan  # the same requests as kube-apiserver's APF counted them
    burst: BurstFigures | None = None  # this controller's burst (ScaleConfig.burst)

    @property
    def backlog_rate(self) -> float:
        """Placements per second of the queue that was there at start-up."""
        if self.backlog_placed < 2 or not self.backlog_s:
            return math.nan
        return (self.backlog_placed - 1) / self.backlog_s

    @property
    def create_rate(self) -> float:
        return self.created / self.churn_s if self.churn_s else math.nan

    @property
    def placement_rate(self) -> float:
        return self.placed_in_churn / self.churn_s if self.churn_s else math.nan

    @property
    def bound_rate(self) -> float:
        return self.bound_in_churn / self.churn_s if self.churn_s else math.nan

    @property
    def overall_rate(self) -> float:
        return self.placed / self.run_s if self.run_s else math.nan


@dataclass(frozen=True)
class _Startup:
    ready_s: float
    model_s: float
    rss_mb: float


@dataclass(frozen=True)
class _Backlog:
    pods: int
    placed: int
    seconds: float
    cpu_ms: float = math.nan  # the controller's, per placement


# -- the benchmark -----------------------------------------------------------------------------


class ScaleBench:
    """Everything one benchmark session needs on one running control plane."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        config: ScaleConfig,
        progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    ) -> None:
        from devcluster.cluster import api_client_for
        from process.kube.jsonclient import KubeJson

        self.info = cluster_info
        self.workdir = workdir
        self.cfg = config
        self.say = progress
        self.admin = api_client_for(Path(cluster_info.kubeconfig))
        self.api = KubeJson(self.admin, request_timeout=60.0)
        self.fleet = GpuFleet(
            self.admin,
            DEFAULT_CONTRACT.driver,
            gpus_per_node=config.gpus_per_node,
            plain_pods_per_node=config.plain_pods_per_node,
            plain_namespace=PLAIN_NAMESPACE,
        )
        self.kubeconfig = self._controller_identity()
        self._serial = 0
        self.meter = CostMeter(
            component_pids(cluster_info.processes),
            lambda: apiserver_metrics(self.admin),
            FLOW_SCHEMA,
        )
        self.native: list[BurstFigures] = []  # one native burst per size (ScaleConfig.burst)

    # -- set-up --------------------------------------------------------------------------------

    def _controller_identity(self) -> Path:
        """A user of its own for the controller, allowed everything, and a FlowSchema that
        matches only it: APF then counts exactly its requests."""
        from devcluster.cluster import client_for_user

        client_for_user(self.info, CONTROLLER_USER)
        path = Path(self.info.root) / "users" / f"{CONTROLLER_USER}.kubeconfig"
        if not path.exists():
            raise RuntimeError(f"devcluster did not write the controller's kubeconfig at {path}")
        rbac = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
        self._create(
            rbac,
            {
                "metadata": {"name": CONTROLLER_USER},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [
                    {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "User",
                        "name": CONTROLLER_USER,
                    }
                ],
            },
        )
        everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}
        self._create(
            "/apis/flowcontrol.apiserver.k8s.io/v1/flowschemas",
            {
                "metadata": {"name": FLOW_SCHEMA},
                "spec": {
                    "matchingPrecedence": 500,
                    "priorityLevelConfiguration": {"name": "workload-high"},
                    "distinguisherMethod": {"type": "ByUser"},
                    "rules": [
                        {
                            "subjects": [{"kind": "User", "user": {"name": CONTROLLER_USER}}],
                            "resourceRules": [
                                {**everything, "clusterScope": True, "namespaces": ["*"]}
                            ],
                            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                        }
                    ],
                },
            },
        )
        return path

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from process.kube.errors import ApiError

        try:
            return self.api.request("POST", path, body=body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            return {}

    def install(self) -> None:
        """carve's DeviceClasses and admission gate, the bench namespace and templates."""
        from devcluster.waiting import wait_for
        from nodesim.stack import CarveStack, gates_pod

        stack = CarveStack(Path(self.info.kubeconfig), self.workdir / "stack")
        try:
            stack.install(controller_user=CONTROLLER_USER)
        finally:
            stack.heartbeater.stop()
        for ns in (NAMESPACE, PLAIN_NAMESPACE):
            self._create("/api/v1/namespaces", {"metadata": {"name": ns}})
            path = f"/api/v1/namespaces/{ns}/serviceaccounts"
            wait_for(
                f"the {ns} namespace's default ServiceAccount",
                lambda p=path: self.api.request("GET", p).get("items"),  # type: ignore[misc]
            )
        self._create("/apis/resource.k8s.io/v1/deviceclasses", native_class())
        for profile in sorted(set(PROFILES)):
            for template in (
                claim_template(profile),
                claim_template(profile, NATIVE_CLASS, NATIVE_TEMPLATES),
            ):
                self._create(
                    f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates",
                    template,
                )
        for profile in sorted(set(PROFILES)):
            wait_for(
                "the admission policy to see the templates",
                lambda p=profile: gates_pod(  # type: ignore[misc]
                    self.api, NAMESPACE, {"resourceClaimTemplateName": f"slice-{p}"}
                ),
            )

    def close(self) -> None:
        self.fleet.stop()

    # -- one measurement -----------------------------------------------------------------------

    def run_size(self, nodes: int) -> list[ScaleFigures]:
        took = self.fleet.grow_to(nodes, self.say)
        self.fleet.start()
        self.say(
            f"fleet: {len(self.fleet.nodes)} nodes, {self.fleet.gpu_count} GPUs, "
            f"{self.fleet.slices} ResourceSlices, {self.fleet.plain_pods} other pods "
            f"(grew in {took:.0f}s)"
        )
        figures = [self.run_controller(label, source) for label, source in self.cfg.controllers]
        if self.cfg.burst:
            self.native.append(self._native_burst())
        return figures

    def _watched(self) -> tuple[PodTracker, Any]:
        """A tracker fed by a watch on the bench namespace's pods, synced; and the watch."""
        from controller.informers import Informer, InformerConfig
        from controller.objects import Kind
        from process.kube.listwatch import JsonCollection

        tracker = PodTracker()

        watcher = Informer(
            Kind.POD,
            JsonCollection(self.api, f"/api/v1/namespaces/{NAMESPACE}/pods"),
            tracker.on_pod,
            lambda _k: None,
            InformerConfig(watch_timeout_s=120, resync_period_s=3600.0),
        )
        threading.Thread(target=watcher.run, args=(time.monotonic,), daemon=True).start()
        while not watcher.has_synced:
            time.sleep(0.05)
        return tracker, watcher

    def _burst_run(self, tracker: PodTracker, ctl: ControllerUnderTest | None) -> BurstRun:
        return BurstRun(
            api=self.api,
            namespace=NAMESPACE,
            meter=self.meter,
            tracker=tracker,
            creators=self.cfg.burst_creators,
            timeout_s=max(self.cfg.drain_s, 600.0),
            controller_pid=ctl.process.pid if ctl else None,
            controller_text=ctl.metrics if ctl else None,
            alive=ctl.alive if ctl else lambda: True,
        )

    def _native_burst(self) -> BurstFigures:
        """The same burst with no carve-controller running: kube-scheduler allocates claims
        of a class that is not carve's on the same devices (the native path)."""
        tracker, watcher = self._watched()
        try:
            burst = run_burst(
                self._burst_run(tracker, None),
                "native",
                len(self.fleet.nodes),
                self.cfg.burst,
                NATIVE_TEMPLATES,
            )
        finally:
            watcher.stop()
        self.say(burst.describe())
        return burst

    def _new_name(self, what: str) -> str:
        self._serial += 1
        return f"{what}-{self._serial:06d}"

    def _create_pod(self, name: str, profile: str, tracker: PodTracker) -> None:
        self.api.request(
            "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body=pod_manifest(name, profile)
        )
        tracker.created(name, time.monotonic())

    def _delete_pod(self, name: str) -> None:
        from process.kube.errors import ApiError

        with contextlib.suppress(ApiError):
            self.api.request(
                "DELETE",
                f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
                body={"gracePeriodSeconds": 0},
            )

    def run_controller(self, label: str, source: Path | None) -> ScaleFigures:
        tracker, watcher = self._watched()
        pods_path = f"/api/v1/namespaces/{NAMESPACE}/pods"
        probe = self._new_name("probe")
        self._create_pod(probe, "1g", tracker)
        backlog = self._create_backlog(tracker)
        log = self.workdir / f"controller-{label}-{len(self.fleet.nodes)}.log"
        ctl = ControllerUnderTest(self.kubeconfig, log, source, self.cfg.controller_cpus)
        try:
            ready_s = self._wait(ctl, ctl.ready, 600, "readyz") - ctl.started
            model_s = (
                self._wait(
                    ctl,
                    lambda: not math.isnan(tracker.snapshot()[probe].placed),
                    600,
                    "the probe pod to be placed",
                )
                - ctl.started
            )
            rss_start = ctl.rss_mb()
            self.say(
                f"[{label} @ {len(self.fleet.nodes)} nodes] ready in {ready_s:.1f}s, "
                f"first placement {model_s:.1f}s after start, RSS {rss_start:.0f} MB; churning"
            )
            queued = self._drain_backlog(label, ctl, tracker, backlog)
            # The churn's window holds every release of its own pods and nobody else's.
            self._clean_up(pods_path, ctl)
            figures = self._churn(label, ctl, tracker, _Startup(ready_s, model_s, rss_start))
            figures = dataclasses.replace(
                figures,
                backlog=queued.pods,
                backlog_placed=queued.placed,
                backlog_s=queued.seconds,
                backlog_cpu_ms=queued.cpu_ms,
            )
            if self.cfg.burst:
                figures = self._carve_burst(label, ctl, tracker, figures)
        finally:
            clean = self._clean_up(pods_path, ctl)
            ctl.stop()
            watcher.stop()
        figures = dataclasses.replace(figures, left_behind=not clean)
        self.say(f"[{label} @ {figures.nodes} nodes] {format_row(figures)}")
        return figures

    def _carve_burst(
        self, label: str, ctl: ControllerUnderTest, tracker: PodTracker, figures: ScaleFigures
    ) -> ScaleFigures:
        """The burst on the carve path, with the controller's RSS sampled throughout."""
        peak = [figures.rss_peak_mb]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.5):
                with contextlib.suppress(OSError):
                    peak[0] = max(peak[0], ctl.rss_mb())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            burst = run_burst(
                self._burst_run(tracker, ctl),
                label,
                len(self.fleet.nodes),
                self.cfg.burst,
                "slice-",
            )
        finally:
            stop.set()
            sampler.join(timeout=5)
        self.say(burst.describe())
        return dataclasses.replace(figures, burst=burst, rss_peak_mb=peak[0])

    def _create_backlog(self, tracker: PodTracker) -> list[str]:
        """`backlog` pods, created while no controller runs, and their claims generated."""
        from devcluster.waiting import wait_for

        names = [self._new_name("queued") for _ in range(self.cfg.backlog)]
        if not names:
            return names
        begin = time.monotonic()
        with ThreadPoolExecutor(self.cfg.creators) as pool:
            list(
                pool.map(
                    lambda i: self._create_pod(names[i], PROFILES[i % len(PROFILES)], tracker),
                    range(len(names)),
                )
            )
        created = time.monotonic() - begin
        claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        wait_for(
            f"kube-controller-manager to create the {len(names)} queued pods' claims",
            lambda: len(self.api.request("GET", claims).get("items") or []) > len(names),
            timeout=600,
            interval=1.0,
        )
        generated = time.monotonic() - begin
        # With no controller running, this is what the control plane alone manages: pods
        # admitted (carve's admission policy) and their claims generated from templates.
        self.say(
            f"backlog: {len(names)} pods and their claims wait for the controller (pods created "
            f"in {created:.1f}s by {self.cfg.creators} creators, {len(names) / created:.1f}/s; "
            f"claims generated after {generated:.1f}s, {len(names) / generated:.1f}/s)"
        )
        return names

    def _drain_backlog(
        self, label: str, ctl: ControllerUnderTest, tracker: PodTracker, names: list[str]
    ) -> _Backlog:
        if not names:
            return _Backlog(0, 0, math.nan)
        cpu0, start = ctl.cpu_s(), time.monotonic()
        with contextlib.suppress(TimeoutError):
            self._wait(
                ctl,
                lambda: all(not math.isnan(tracker.snapshot()[n].placed) for n in names),
                self.cfg.drain_s,
                "the backlog to be placed",
            )
        snap = tracker.snapshot()
        times = sorted(snap[n].placed for n in names if not math.isnan(snap[n].placed))
        seconds = times[-1] - times[0] if len(times) > 1 else math.nan
        in_window = sum(1 for t in times if t >= start)
        cpu_ms = (ctl.cpu_s() - cpu0) * 1000 / in_window if in_window else math.nan
        queued = _Backlog(len(names), len(times), seconds, cpu_ms)
        self.say(
            f"[{label} @ {len(self.fleet.nodes)} nodes] backlog: {len(times)}/{len(names)} "
            f"placed in {seconds:.1f}s; controller CPU {cpu_ms:.1f} ms per placement "
            f"(over the {in_window} placed after its first)"
        )
        return queued

    def _wait(
        self, ctl: ControllerUnderTest, done: Callable[[], bool], timeout: float, what: str
    ) -> float:
        deadline = time.monotonic() + timeout
        while not done():
            if not ctl.alive():
                raise RuntimeError(
                    f"carve-controller exited ({ctl.process.exit_code()}) waiting for {what}:\n"
                    + ctl.process.log_tail(30)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"carve-controller: {what} not reached in {timeout:.0f}s")
            time.sleep(0.05)
        return time.monotonic()

    def _churn(
        self,
        label: str,
        ctl: ControllerUnderTest,
        tracker: PodTracker,
        startup: _Startup,
    ) -> ScaleFigures:
        cfg = self.cfg
        m0, a0 = ctl.metrics(), apiserver_metrics(self.admin)
        total = max(1, round(cfg.rate * cfg.duration_s))
        names = [self._new_name("pod") for _ in range(total)]
        stop = threading.Event()
        rss_peak = [startup.rss_mb]
        deleted: set[str] = set()

        def sample_and_delete() -> None:
            with ThreadPoolExecutor(2) as pool:
                while not stop.wait(0.5):
                    with contextlib.suppress(OSError):
                        rss_peak[0] = max(rss_peak[0], ctl.rss_mb())
                    now = time.monotonic()
                    due = [
                        n
                        for n, t in tracker.snapshot().items()
                        if n not in deleted and now - t.bound >= cfg.hold_s
                    ]
                    deleted.update(due)
                    list(pool.map(self._delete_pod, due))

        janitor = threading.Thread(target=sample_and_delete, daemon=True)
        janitor.start()
        begin = time.monotonic()

        def create(worker: int) -> None:
            for i in range(worker, total, cfg.creators):
                delay = begin + i / cfg.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self._create_pod(names[i], PROFILES[i % len(PROFILES)], tracker)

        with ThreadPoolExecutor(cfg.creators) as pool:
            list(pool.map(create, range(cfg.creators)))
        churn_end = max(time.monotonic(), begin + cfg.duration_s)
        while time.monotonic() < churn_end:
            time.sleep(0.05)
        snap = tracker.snapshot()
        placed_in_churn = sum(1 for n in names if snap[n].placed <= churn_end)
        bound_in_churn = sum(1 for n in names if snap[n].bound <= churn_end)
        drain_until = time.monotonic() + cfg.drain_s
        while time.monotonic() < drain_until:
            snap = tracker.snapshot()
            if all(not math.isnan(snap[n].placed) for n in names):
                break
            time.sleep(0.2)
        # The window runs on until every churned pod is deleted and its claim released.
        self._until_released(ctl, lambda: deleted.issuperset(names), cfg.drain_s)
        stop.set()
        janitor.join(timeout=30)
        self.meter.settled(ctl.process.pid, ctl.metrics)
        m1, a1 = ctl.metrics(), apiserver_metrics(self.admin)
        snap = tracker.snapshot()
        placed_times = [snap[n].placed for n in names if not math.isnan(snap[n].placed)]
        requests = sum(carve_requests(m1).values()) - sum(carve_requests(m0).values())
        b0 = promtext.buckets(m0, "carve_decision_seconds")
        b1 = promtext.buckets(m1, "carve_decision_seconds")
        decisions = int(b1.get(math.inf, 0.0) - b0.get(math.inf, 0.0))
        c0 = promtext.buckets(m0, "carve_decision_cpu_seconds")
        c1 = promtext.buckets(m1, "carve_decision_cpu_seconds")
        return ScaleFigures(
            controller=label,
            nodes=len(self.fleet.nodes),
            gpus=self.fleet.gpu_count,
            slices=self.fleet.slices,
            ready_s=startup.ready_s,
            model_s=startup.model_s,
            rss_start_mb=startup.rss_mb,
            rss_peak_mb=rss_peak[0],
            created=total,
            placed=len(placed_times),
            bound=sum(1 for n in names if not math.isnan(snap[n].bound)),
            churn_s=churn_end - begin,
            placed_in_churn=placed_in_churn,
            bound_in_churn=bound_in_churn,
            run_s=(max(placed_times) - begin) if placed_times else math.nan,
            decisions=decisions,
            decision_p50_ms=promtext.quantile(b0, b1, 0.5) * 1000,
            decision_p99_ms=promtext.quantile(b0, b1, 0.99) * 1000,
            decision_cpu_p99_ms=promtext.quantile(c0, c1, 0.99) * 1000,
            requests=requests,
            requests_per_pod=requests / total,
            apf_requests=controller_requests(a1) - controller_requests(a0),
            bound_off_fleet=sum(
                1 for n in names if snap[n].node and snap[n].node not in self.fleet.nodes
            ),
        )

    def _until_released(
        self, ctl: ControllerUnderTest, all_deleted: Callable[[], bool], timeout: float
    ) -> bool:
        """Wait until every pod is deleted and no claim is left in the bench namespace."""
        claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and ctl.alive():
            if (
                all_deleted()
                and not self.api.request("GET", pods, query=[("limit", "1")]).get("items")
                and not self.api.request("GET", claims, query=[("limit", "1")]).get("items")
            ):
                return True
            time.sleep(0.5)
        return False

    def _clean_up(self, pods_path: str, ctl: ControllerUnderTest, timeout: float = 300.0) -> bool:
        """Delete every bench pod and wait for their claims to go (the controller, still
        running, drops its finalizer), so the next controller starts on an empty cluster."""
        from process.kube.errors import ApiError

        with contextlib.suppress(ApiError):
            self.api.request("DELETE", pods_path, query=[("gracePeriodSeconds", "0")], body={})
        claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.api.request("GET", pods_path, query=[("limit", "1")]).get("items")
            left = self.api.request("GET", claims, query=[("limit", "1")]).get("items")
            if not pods and not left:
                return True
            if not ctl.alive():
                break
            time.sleep(0.5)
        self.say("warning: bench pods or claims were left behind; later figures may suffer")
        return False


HEADER = (
    f"{'controller':<11}{'nodes':>6}{'GPUs':>6}{'ready s':>8}{'model s':>8}{'RSS MB':>8}"
    f"{'peak MB':>8}{'dec p50':>8}{'dec p99':>8}{'cpu p99':>8}{'create/s':>9}{'placed/s':>9}"
    f"{'bound/s':>8}"
    f"{'all/s':>7}{'req/pod':>8}{'placed':>9}{'queue/s':>8}{'cpu/pl':>7}"
)


def format_row(f: ScaleFigures) -> str:
    return (
        f"{f.controller:<11}{f.nodes:>6}{f.gpus:>6}{f.ready_s:>8.1f}{f.model_s:>8.1f}"
        f"{f.rss_start_mb:>8.0f}{f.rss_peak_mb:>8.0f}{f.decision_p50_ms:>8.2f}"
        f"{f.decision_p99_ms:>8.2f}{f.decision_cpu_p99_ms:>8.2f}{f.create_rate:>9.1f}{f.placement_rate:>9.1f}"
        f"{f.bound_rate:>8.1f}{f.overall_rate:>7.1f}{f.requests_per_pod:>8.2f}"
        f"{f.placed:>5}/{f.created:<4}{f.backlog_rate:>8.1f}{f.backlog_cpu_ms:>7.1f}"
    )


def figures_json(figures: Sequence[ScaleFigures], native: Sequence[BurstFigures] = ()) -> str:
    """The run's figures for a script: each controller's, and the native path's bursts. The
    controller's request counts are keyed `"<verb> <resource>"` (JSON keys are strings)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {" ".join(k) if isinstance(k, tuple) else k: plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return value

    body = {
        "controllers": [plain(dataclasses.asdict(f)) for f in figures],
        "native": [plain(dataclasses.asdict(n)) for n in native],
    }
    return json.dumps(body, indent=1, default=str)
