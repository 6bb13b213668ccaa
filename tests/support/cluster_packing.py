"""The machinery of ``python -m bench.cluster_packing`` (the command line and what it measures
are explained there): one control plane, one fleet, the arms one after the other.

It lives here, not in bench/, so that tests/bench/test_cluster_packing.py can run it on a small
fleet (tests never import bench/).

- The fleet: ``tests.support.gpufleet`` nodes (Node objects, Leases renewed, the exact
  ResourceSlices carve's plugin publishes), each with the workload's model, GPU count, cpu and
  memory.
- The node side, :class:`NodeStandIn`: no kubelet or plugin runs, so this plays their part in
  the claim's life as the plugin does it (``kubeletplugin.claims.KubernetesClaimClient``, the
  plugin's own code): when a pod is bound, it adds the node's finalizer to the pod's claims
  (the plugin does so when it carves, at prepare); when the pod is gone, it waits
  ``destroy_s`` (the simulator's GI destroy) and removes it (the plugin does so once the MIG
  instance is destroyed). carve's controller frees a placement only after that (DESIGN
  invariant 4), and on the native path the claim, and with it its devices, stays until then.
- An arm (:meth:`ClusterPacking.run_arm`): a namespace of its own with one
  ResourceClaimTemplate per distinct request; pods created at their arrival times by a few
  creator threads; each pod deleted ``lifetime`` seconds after it was seen bound (with no
  kubelet, bound is when a pod would start); a carve arm runs a fresh carve-controller with
  ``--packing-policy``, a scheduler arm runs none and its claims use DeviceClasses outside
  carve's set (``tests.bench.through_cluster.NATIVE_CLASSES``) that select the same devices.
  The arm ends once every job was bound, or ``drain_s`` after the last arrival; its pods are
  then deleted and the bench waits for their claims to go, so the next arm starts on an empty
  fleet.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.placement import DEFAULT_POLICY, Policy
from driver.contract import DEFAULT_CONTRACT
from tests.bench.alibaba import DRIVER, GPU_CLASS, MIG_CLASS, claim_spec
from tests.bench.cluster_figures import JobRecord
from tests.bench.cluster_workload import NodeSpec, TimedJob, Workload
from tests.bench.through_cluster import NATIVE_CLASSES, native_spec
from tests.support.gpufleet import FleetNode, GpuFleet, node_slices

BINPACK_SCHEDULER = "bench-binpack"
SCHEDULER_PROFILES: tuple[Mapping[str, Any], ...] = (
    # kube-scheduler's default profile, untouched: what a user gets by default.
    {"schedulerName": "default-scheduler"},
    # Bin packing as the Kubernetes documentation configures it ("Resource Bin Packing"):
    # NodeResourcesFit scores with MostAllocated. Its DRA-aware part (DRAExtendedResource)
    # counts only extended resources a pod requests in resources.requests, and the
    # DynamicResources plugin scores only firstAvailable preferences, so for pods that ask
    # through ResourceClaims cpu and memory are what v1.37 can score.
    {
        "schedulerName": BINPACK_SCHEDULER,
        "pluginConfig": [
            {
                "name": "NodeResourcesFit",
                "args": {
                    "scoringStrategy": {
                        "type": "MostAllocated",
                        "resources": [
                            {"name": "cpu", "weight": 1},
                            {"name": "memory", "weight": 1},
                        ],
                    }
                },
            }
        ],
    },
)
"""The KubeSchedulerConfiguration's profiles (``devcluster.components.scheduler_config``)."""

NAMESPACE_PREFIX = "cp"
_GATE = DEFAULT_CONTRACT.scheduling_gate
_MIB = 2**20


@dataclass(frozen=True)
class Arm:
    """One way of placing the jobs: carve's controller with a policy, or kube-scheduler with
    a profile on the native path."""

    name: str
    policy: Policy | None  # carve arms
    scheduler: str  # the pods' schedulerName

    @property
    def carve(self) -> bool:
        return self.policy is not None


def parse_arm(name: str) -> Arm:
    """``carve`` (the controller's default policy), ``carve-<policy>``, ``scheduler-default``
    or ``scheduler-binpack``."""
    if name == "carve":
        return Arm(f"carve-{DEFAULT_POLICY.value}", DEFAULT_POLICY, "default-scheduler")
    if name.startswith("carve-"):
        try:
            return Arm(name, Policy(name.removeprefix("carve-")), "default-scheduler")
        except ValueError:
            pass
    if name == "scheduler-default":
        return Arm(name, None, "default-scheduler")
    if name == "scheduler-binpack":
        return Arm(name, None, BINPACK_SCHEDULER)
    choices = ", ".join(
        ["carve", *(f"carve-{p.value}" for p in Policy), "scheduler-default", "scheduler-binpack"]
    )
    raise ValueError(f"unknown arm {name!r}; one of {choices}")


@dataclass(frozen=True)
class ArmSettings:
    drain_s: float = 300.0  # after the last arrival, at most
    destroy_s: float = 1.0  # the stand-in's MIG destroy
    creators: int = 6
    progress_s: float = 15.0
    cleanup_s: float = 300.0


@dataclass(frozen=True)
class ArmRun:
    """What one arm recorded."""

    arm: str
    records: Mapping[str, JobRecord]
    end: float  # seconds from the arm's start to when it stopped watching
    create_lag_p99: float  # how late the creators were (created - arrival), p99
    carve_allocated: frozenset[str] = frozenset()  # pods whose claims carve allocated
    handshakes: tuple[int, int] = (0, 0)  # node finalizers the stand-in added, removed
    scheduled_by_profile: float = math.nan  # pods kube-scheduler's arm profile scheduled
    notes: tuple[str, ...] = ()


def fleet_nodes(nodes: Sequence[NodeSpec]) -> list[FleetNode]:
    return [
        FleetNode(i, n.name, n.model, n.gpus, f"{n.cpu_milli}m", f"{n.memory_mib}Mi")
        for i, n in enumerate(nodes)
    ]


def fleet_slices(nodes: Sequence[NodeSpec]) -> list[dict[str, Any]]:
    """The slices the fleet publishes (the same function makes them for the apiserver)."""
    return [s for n in fleet_nodes(nodes) for s in node_slices(n, DRIVER)]


def pod_manifest(job: TimedJob, template: str, scheduler: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        "containers": [
            {
                "name": "work",
                "image": "registry.invalid/bench:never-pulled",
                "resources": {
                    "requests": {"cpu": f"{job.cpu_milli}m", "memory": f"{job.memory_mib}Mi"},
                    "claims": [{"name": "gpu"}],
                },
            }
        ],
    }
    if scheduler != "default-scheduler":
        spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": job.name, "labels": {"bench.carve.dev/class": job.size_class}},
        "spec": spec,
    }


# ---------------------------------------------------------------------------------------------
# The node side


class NodeStandIn:
    """The plugin's finalizer handshake for every pod of one namespace (module docstring).

    Each pod's steps run in order on one worker (chosen by the pod's name), so a pod's
    unprepare never overtakes its prepare."""

    def __init__(self, api: Any, namespace: str, destroy_s: float, workers: int = 4) -> None:
        from kubeletplugin.claims import KubernetesClaimClient

        self._claims = KubernetesClaimClient(api)
        self._ns = namespace
        self._destroy_s = destroy_s
        self._queues: list[queue.Queue[Callable[[], None] | None]] = [
            queue.Queue() for _ in range(workers)
        ]
        self._prepared: dict[str, list[tuple[str, str, str]]] = {}  # pod -> (claim, uid, fin)
        self._lock = threading.Lock()
        self._timers: list[tuple[float, int, str]] = []
        self._timer_wake = threading.Condition(self._lock)
        self._serial = 0
        self._stop = threading.Event()
        self.devices: dict[str, tuple[Any, ...]] = {}  # pod -> devices its claims got
        # Pods whose every claim carried carve's allocation finalizer when the node saw it.
        self.carve_allocated: set[str] = set()
        self.finalizers_added = 0
        self.finalizers_removed = 0
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._work, args=(q,), daemon=True) for q in self._queues
        ]
        self._threads.append(threading.Thread(target=self._timer_loop, daemon=True))
        for t in self._threads:
            t.start()

    def _queue_for(self, pod: str) -> queue.Queue[Callable[[], None] | None]:
        return self._queues[hash(pod) % len(self._queues)]

    def bound(self, pod: str, node: str, claims: Sequence[str]) -> None:
        self._queue_for(pod).put(lambda: self._prepare(pod, node, claims))

    def gone(self, pod: str) -> None:
        with self._timer_wake:
            self._serial += 1
            heapq.heappush(self._timers, (time.monotonic() + self._destroy_s, self._serial, pod))
            self._timer_wake.notify()

    def _prepare(self, pod: str, node: str, claims: Sequence[str]) -> None:
        from kubeletplugin.claims import ClaimGoneError

        finalizer = DEFAULT_CONTRACT.node_finalizer(node)
        done: list[tuple[str, str, str]] = []
        devices: list[Any] = []
        by_carve = bool(claims)
        for name in claims:
            try:
                view = self._claims.get(self._ns, name)
                if view is None:
                    continue
                devices.extend(view.results_for(DRIVER))
                by_carve &= DEFAULT_CONTRACT.allocation_finalizer in view.finalizers
                self._claims.add_finalizer(self._ns, name, view.uid, finalizer)
                done.append((name, view.uid, finalizer))
                with self._lock:
                    self.finalizers_added += 1
            except ClaimGoneError:
                continue
            except Exception as exc:  # recorded, never fatal: the figures say how many
                self.errors.append(f"prepare {pod}/{name}: {exc}")
        with self._lock:
            self._prepared[pod] = done
            self.devices[pod] = tuple(devices)
            if by_carve:
                self.carve_allocated.add(pod)

    def _unprepare(self, pod: str) -> None:
        with self._lock:
            done = self._prepared.pop(pod, [])
        for name, uid, finalizer in done:
            try:
                self._claims.remove_finalizer(self._ns, name, uid, finalizer)
                with self._lock:
                    self.finalizers_removed += 1
            except Exception as exc:
                self.errors.append(f"unprepare {pod}/{name}: {exc}")

    def _timer_loop(self) -> None:
        while not self._stop.is_set():
            with self._timer_wake:
                while not self._stop.is_set() and (
                    not self._timers or self._timers[0][0] > time.monotonic()
                ):
                    wait = self._timers[0][0] - time.monotonic() if self._timers else 1.0
                    self._timer_wake.wait(max(0.01, min(1.0, wait)))
                if self._stop.is_set():
                    return
                _, _, pod = heapq.heappop(self._timers)
            self._queue_for(pod).put(lambda p=pod: self._unprepare(p))  # type: ignore[misc]

    def _work(self, q: queue.Queue[Callable[[], None] | None]) -> None:
        while True:
            step = q.get()
            if step is None:
                return
            step()

    def pending(self) -> int:
        with self._lock:
            return len(self._timers) + sum(q.qsize() for q in self._queues)

    def stop(self) -> None:
        self._stop.set()
        with self._timer_wake:
            self._timer_wake.notify_all()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)


# ---------------------------------------------------------------------------------------------
# The pods of an arm


@dataclass
class _Seen:
    created: float = math.nan
    bound: float = math.nan
    node: str = ""
    ended: float = math.nan
    claims: tuple[str, ...] = ()


@dataclass
class _ArmState:
    """Watch-fed, shared by the arm's threads under ``lock``."""

    begin: float
    lifetimes: Mapping[str, float]
    stand_in: NodeStandIn
    seen: dict[str, _Seen] = field(default_factory=dict)
    due: list[tuple[float, str]] = field(default_factory=list)  # (delete at, pod), a heap
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set when the arm ends: binds seen later (the clean-up frees room, and kube-scheduler
    # binds what still waits) are not the arm's.
    closed: bool = False

    def now(self) -> float:
        return time.monotonic() - self.begin

    def on_pod(self, _kind: Any, type_: Any, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if name not in self.lifetimes:
            return
        if str(type_) == "DELETED":
            self.stand_in.gone(name)
            return
        spec = obj.get("spec") or {}
        node = spec.get("nodeName")
        if not node:
            return
        with self.lock:
            if self.closed:
                return
            s = self.seen.setdefault(name, _Seen())
            if not math.isnan(s.bound):
                return
            s.bound, s.node = self.now(), str(node)
            claims = tuple(
                c["resourceClaimName"]
                for c in (obj.get("status") or {}).get("resourceClaimStatuses") or []
                if c.get("resourceClaimName")
            )
            s.claims = claims
            heapq.heappush(self.due, (s.bound + self.lifetimes[name], name))
        self.stand_in.bound(name, str(node), claims)


@dataclass(frozen=True)
class _Creation:
    """What the creator threads of one arm share."""

    namespace: str
    arm: Arm
    templates: Mapping[str, str]
    state: _ArmState
    stop: threading.Event


def scheduler_metrics(info: Any) -> str:
    """kube-scheduler's /metrics, read with the cluster admin's certificate."""
    import ssl
    import urllib.request

    from devcluster.components import Layout

    pki = Layout(Path(info.root)).pki_dir
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.check_hostname = False  # the serving certificate is kube-scheduler's own, self-signed
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    url = f"https://127.0.0.1:{info.ports.scheduler}/metrics"
    with urllib.request.urlopen(url, context=ctx, timeout=30) as resp:
        return str(resp.read().decode())


@dataclass(frozen=True)
class SchedulerWork:
    """What kube-scheduler did during an arm: attempts by result, and its CPU seconds."""

    scheduled: float  # by the profile read
    unschedulable: float
    cpu_s: float

    @classmethod
    def read(cls, info: Any, profile: str) -> SchedulerWork:
        from tests.support import promtext

        try:
            text = scheduler_metrics(info)
        except OSError:
            return cls(math.nan, math.nan, math.nan)
        attempts = "scheduler_schedule_attempts_total"
        return cls(
            promtext.counter_sum(text, attempts, result="scheduled", profile=profile),
            promtext.counter_sum(text, attempts, result="unschedulable", profile=profile),
            promtext.counter_sum(text, "process_cpu_seconds_total"),
        )

    def since(self, before: SchedulerWork) -> str:
        return (
            f"kube-scheduler: {self.scheduled - before.scheduled:.0f} pods scheduled, "
            f"{self.unschedulable - before.unschedulable:.0f} attempts unschedulable, "
            f"{self.cpu_s - before.cpu_s:.0f} CPU seconds"
        )


class ClusterPacking:
    """One control plane with the fleet installed; runs arms on it, one at a time."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        workload: Workload,
        settings: ArmSettings = ArmSettings(),
        progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    ) -> None:
        from devcluster.cluster import api_client_for
        from kubeletplugin.claims import KubeJson

        self.info = cluster_info
        self.workdir = workdir
        self.workload = workload
        self.settings = settings
        self.say = progress
        self.admin = api_client_for(Path(cluster_info.kubeconfig))
        self.api = KubeJson(self.admin, request_timeout=60.0)
        self.fleet = GpuFleet(self.admin, DRIVER)
        self._arms = 0

    # -- set-up --------------------------------------------------------------------------------

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from kubeletplugin.claims import ApiError

        try:
            return self.api.request("POST", path, body=body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            return {}

    def install(self) -> float:
        """carve's DeviceClasses and admission gate, the native path's DeviceClasses, and the
        fleet; returns the seconds the fleet took to grow."""
        from nodesim.stack import CarveStack

        stack = CarveStack(Path(self.info.kubeconfig), self.workdir / "stack")
        try:
            stack.install()
        finally:
            stack.heartbeater.stop()
        for kind, name in (("mig", NATIVE_CLASSES[MIG_CLASS]), ("gpu", NATIVE_CLASSES[GPU_CLASS])):
            expression = (
                f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{kind}"'
            )
            self._create(
                "/apis/resource.k8s.io/v1/deviceclasses",
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": name},
                    "spec": {"selectors": [{"cel": {"expression": expression}}]},
                },
            )
        took = self.fleet.add(fleet_nodes(self.workload.nodes), self.say)
        self.fleet.start()
        return took

    def close(self) -> None:
        self.fleet.stop()

    # -- one arm -------------------------------------------------------------------------------

    def _templates(self, namespace: str, arm: Arm) -> dict[str, str]:
        """One ResourceClaimTemplate per distinct request; job name -> template name."""
        from devcluster.waiting import wait_for
        from nodesim.stack import gates_pod

        names: dict[str, str] = {}
        by_spec: dict[str, str] = {}
        for job in self.workload.jobs:
            spec = claim_spec(job.request)
            key = json.dumps(spec, sort_keys=True)
            if key not in by_spec:
                tname = by_spec[key] = f"t{len(by_spec):03d}"
                self._create(
                    f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates",
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceClaimTemplate",
                        "metadata": {"name": tname},
                        "spec": {"spec": spec if arm.carve else native_spec(spec)},
                    },
                )
            names[job.name] = by_spec[key]
        if arm.carve:
            for tname in sorted(set(by_spec.values())):
                wait_for(
                    "the admission policy to see the templates",
                    lambda t=tname: gates_pod(  # type: ignore[misc]
                        self.api, namespace, {"resourceClaimTemplateName": t}
                    ),
                )
        return names

    def run_arm(self, arm: Arm) -> ArmRun:
        from controller.informers import Informer, InformerConfig
        from controller.reconciler import Kind
        from tests.support.scale import ControllerUnderTest

        self._arms += 1
        namespace = f"{NAMESPACE_PREFIX}{self._arms}-{arm.name}"
        self._create("/api/v1/namespaces", {"metadata": {"name": namespace}})
        self._wait_service_account(namespace)
        templates = self._templates(namespace, arm)
        ctl = None
        if arm.carve:
            assert arm.policy is not None
            ctl = ControllerUnderTest(
                Path(self.info.kubeconfig),
                self.workdir / f"controller-{arm.name}.log",
                None,
                extra=(f"--packing-policy={arm.policy.value}",),
            )
            deadline = time.monotonic() + 300
            while not ctl.ready():
                if not ctl.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"carve-controller not ready:\n{ctl.process.log_tail(30)}")
                time.sleep(0.2)
        stand_in = NodeStandIn(self.api, namespace, self.settings.destroy_s)
        lifetimes = {j.name: j.lifetime for j in self.workload.jobs}
        state = _ArmState(time.monotonic(), lifetimes, stand_in)

        def list_pods(**kwargs: Any) -> Any:
            from kubernetes import client

            return client.CoreV1Api(self.admin).list_namespaced_pod(namespace, **kwargs)

        watcher = Informer(
            Kind.POD,
            list_pods,
            state.on_pod,
            lambda _k: None,
            InformerConfig(watch_timeout_s=120, resync_period_s=None),
        )
        threading.Thread(target=watcher.run, args=(time.monotonic,), daemon=True).start()
        while not watcher.has_synced:
            time.sleep(0.05)
        notes: list[str] = []
        stop = threading.Event()
        work0 = SchedulerWork.read(self.info, arm.scheduler)
        cpu0 = ctl.cpu_s() if ctl is not None else math.nan
        try:
            state.begin = time.monotonic()
            threads = [
                threading.Thread(
                    target=self._create_pods,
                    args=(_Creation(namespace, arm, templates, state, stop), w),
                    daemon=True,
                )
                for w in range(self.settings.creators)
            ]
            threads.append(
                threading.Thread(
                    target=self._delete_due, args=(namespace, state, stop), daemon=True
                )
            )
            for t in threads:
                t.start()
            end = self._watch_until_done(arm, state, ctl)
            with state.lock:
                state.closed = True
            stop.set()
            work = SchedulerWork.read(self.info, arm.scheduler)
            notes.append(work.since(work0))
            if ctl is not None:
                notes.append(f"carve-controller: {ctl.cpu_s() - cpu0:.0f} CPU seconds")
            for t in threads:
                t.join(timeout=30)
        finally:
            stop.set()
            clean = self._clean_up(namespace, ctl)
            if not clean:
                notes.append("pods or claims were left behind after the arm")
            stand_in.stop()
            watcher.stop()
            if ctl is not None:
                ctl.stop()
        if stand_in.errors:
            notes.append(f"{len(stand_in.errors)} stand-in errors, e.g. {stand_in.errors[0]}")
        with state.lock:
            records = {
                name: JobRecord(
                    name,
                    s.created,
                    None if math.isnan(s.bound) else s.bound,
                    s.node,
                    stand_in.devices.get(name, ()),
                    None if math.isnan(s.ended) else s.ended,
                )
                for name, s in state.seen.items()
                if not math.isnan(s.created)
            }
        lags = sorted(
            r.created - j.arrival for j in self.workload.jobs if (r := records.get(j.name))
        )
        lag = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else math.nan
        return ArmRun(
            arm.name,
            records,
            end,
            lag,
            frozenset(stand_in.carve_allocated),
            (stand_in.finalizers_added, stand_in.finalizers_removed),
            work.scheduled - work0.scheduled,
            tuple(notes),
        )

    def _wait_service_account(self, namespace: str) -> None:
        from devcluster.waiting import wait_for

        path = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        wait_for(
            f"the {namespace} namespace's default ServiceAccount",
            lambda: self.api.request("GET", path).get("items"),
        )

    def _create_pods(self, c: _Creation, worker: int) -> None:
        from kubeletplugin.claims import ApiError

        jobs = self.workload.jobs
        for i in range(worker, len(jobs), self.settings.creators):
            job = jobs[i]
            delay = job.arrival - c.state.now()
            if delay > 0 and c.stop.wait(delay):
                return
            if c.stop.is_set():
                return
            try:
                self.api.request(
                    "POST",
                    f"/api/v1/namespaces/{c.namespace}/pods",
                    body=pod_manifest(job, c.templates[job.name], c.arm.scheduler),
                )
            except ApiError as exc:
                self.say(f"[{c.arm.name}] creating {job.name} failed: {exc}")
                continue
            with c.state.lock:
                c.state.seen.setdefault(job.name, _Seen()).created = c.state.now()

    def _delete_due(self, namespace: str, state: _ArmState, stop: threading.Event) -> None:
        from kubeletplugin.claims import ApiError

        def delete(name: str) -> None:
            with contextlib.suppress(ApiError):
                self.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{namespace}/pods/{name}",
                    body={"gracePeriodSeconds": 0},
                )

        with ThreadPoolExecutor(2) as pool:
            while not stop.is_set():
                due: list[str] = []
                with state.lock:
                    now = state.now()
                    while state.due and state.due[0][0] <= now:
                        _, name = heapq.heappop(state.due)
                        state.seen[name].ended = now
                        due.append(name)
                list(pool.map(delete, due))
                stop.wait(0.1)

    def _watch_until_done(self, arm: Arm, state: _ArmState, ctl: Any) -> float:
        jobs = self.workload.jobs
        last = self.workload.last_arrival
        deadline = last + self.settings.drain_s
        next_say = self.settings.progress_s
        while True:
            now = state.now()
            with state.lock:
                created = sum(1 for s in state.seen.values() if not math.isnan(s.created))
                bound = sum(1 for s in state.seen.values() if not math.isnan(s.bound))
                ended = sum(1 for s in state.seen.values() if not math.isnan(s.ended))
            if created == len(jobs) and bound == len(jobs):
                self.say(f"[{arm.name}] {now:.0f}s: all {bound} jobs bound")
                return now
            if now > deadline:
                self.say(
                    f"[{arm.name}] {now:.0f}s: drain over ({self.settings.drain_s:g}s after the "
                    f"last arrival); {len(jobs) - bound} jobs never bound"
                )
                return now
            if ctl is not None and not ctl.alive():
                raise RuntimeError(f"carve-controller exited:\n{ctl.process.log_tail(30)}")
            if now >= next_say:
                next_say += self.settings.progress_s
                self.say(
                    f"[{arm.name}] {now:.0f}s: created {created}/{len(jobs)}, bound {bound}, "
                    f"running {bound - ended}, waiting {created - bound}, ended {ended}"
                )
            time.sleep(0.2)

    def _clean_up(self, namespace: str, ctl: Any) -> bool:
        """Delete the arm's pods and wait for their claims to go (the stand-in drops its
        finalizers, carve's controller its own), so the next arm starts on an empty fleet."""
        from kubeletplugin.claims import ApiError

        pods = f"/api/v1/namespaces/{namespace}/pods"
        claims = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        with contextlib.suppress(ApiError):
            self.api.request("DELETE", pods, query=[("gracePeriodSeconds", "0")], body={})
        deadline = time.monotonic() + self.settings.cleanup_s
        while time.monotonic() < deadline:
            left_pods = self.api.request("GET", pods, query=[("limit", "1")]).get("items")
            left = self.api.request("GET", claims, query=[("limit", "1")]).get("items")
            if not left_pods and not left:
                return True
            if ctl is not None and not ctl.alive():
                break
            time.sleep(0.5)
        self.say(f"warning: pods or claims of {namespace} were left behind")
        return False
