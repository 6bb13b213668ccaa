"""The machinery of ``python -m bench.cluster_packing`` (the command line and what it measures
are explained there): one control plane, every arm at the same time on a fleet of its own.

It lives here, not in bench/, so that tests/bench/test_cluster_packing.py can run it on a small
fleet (tests never import bench/).

- **All arms at once.** Each arm gets its own copy of the workload's fleet (node names prefixed
  ``a<i>-``, labelled :data:`ARM_LABEL`), its own namespace, and its pods select their copy
  with a nodeSelector. Arms run side by side because this is a shared machine whose load moves
  by the minute: one after the other, each arm would meet a different machine. Side by side
  they meet the same one, and each arm's own placement loop stays its own:
- **carve arm** (at most one per run): a fresh carve-controller with ``--packing-policy``;
- **scheduler arms**: their claims use DeviceClasses outside carve's set that select the same
  devices (``tests.bench.through_cluster.NATIVE_CLASSES``), so carve's gate and controller
  leave them;
- every arm has a kube-scheduler process of its own (``tests.support.packing_arms``): a
  scheduler arm's places its pods with the arm's profile, carve's binds what carve placed.
- **The fleet**: ``tests.support.gpufleet`` nodes (Node objects, Leases renewed, the exact
  ResourceSlices carve's plugin publishes), each with the workload's model, GPU count, cpu and
  memory.
- **The node side**: ``tests.support.node_standin.NodeStandIn`` does the plugin's finalizer
  handshake on each claim, so carve's release and the native path's claim deletion run as on
  a real cluster.
- **An arm's jobs**: one ResourceClaimTemplate per distinct request; pods created at their
  arrival times by a few creator threads; each pod deleted ``lifetime`` seconds after it was
  seen bound (with no kubelet, bound is when a pod would start). An arm's figures stop at its
  own end (every job bound, or ``drain_s`` after the last arrival), but its pods keep churning
  until every arm has ended, so the load on the machine stays the same for all. Then every
  pod is deleted and the bench waits for the claims to go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.apiviews import ClaimView, ObjectView
from tests.bench.alibaba import DRIVER, GPU_CLASS, MIG_CLASS, claim_spec
from tests.bench.cluster_figures import JobRecord
from tests.bench.cluster_workload import NodeSpec, TimedJob, Workload
from tests.bench.through_cluster import NATIVE_CLASSES, native_spec
from tests.support.gpufleet import FleetNode, GpuFleet, node_slices
from tests.support.node_standin import NodeStandIn
from tests.support.packing_arms import ARM_LABEL, Arm, ArmScheduler, SchedulerWork

NAMESPACE_PREFIX = "cp"


@dataclass(frozen=True)
class ArmSettings:
    drain_s: float = 60.0  # after the last arrival, at most
    destroy_s: float = 1.0  # the stand-in's MIG destroy
    creators: int = 3  # per arm
    progress_s: float = 15.0
    cleanup_s: float = 300.0


@dataclass(frozen=True)
class ArmRun:
    """What one arm recorded; node names and device pools are the workload's (unprefixed)."""

    arm: str
    records: Mapping[str, JobRecord]
    end: float  # seconds from the start to the arm's end
    create_lag_p99: float  # how late the creators were (created - arrival), p99
    carve_allocated: frozenset[str] = frozenset()  # pods whose claims carve allocated
    handshakes: tuple[int, int] = (0, 0)  # node finalizers the stand-in added, removed
    scheduled_by_profile: float = math.nan  # pods the arm's own kube-scheduler scheduled
    notes: tuple[str, ...] = ()


def fleet_nodes(nodes: Sequence[NodeSpec], arm: int = 0, label: str = "") -> list[FleetNode]:
    """Arm ``arm``'s copy of the fleet: names prefixed ``a<arm>-``, labelled with ``label``."""
    return [
        FleetNode(
            arm * 10_000 + i,
            f"a{arm}-{n.name}",
            n.model,
            n.gpus,
            f"{n.cpu_milli}m",
            f"{n.memory_mib}Mi",
            ((ARM_LABEL, label),) if label else (),
        )
        for i, n in enumerate(nodes)
    ]


def fleet_slices(nodes: Sequence[NodeSpec]) -> list[dict[str, Any]]:
    """The slices the fleet publishes, with the workload's own node names (each arm's copy
    publishes these under its prefixed names)."""
    return [
        s
        for i, n in enumerate(nodes)
        for s in node_slices(FleetNode(i, n.name, n.model, n.gpus), DRIVER)
    ]


def pod_manifest(job: TimedJob, template: str, arm: Arm) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "nodeSelector": {ARM_LABEL: arm.name},
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
    spec["schedulerName"] = arm.scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": job.name, "labels": {"bench.carve.dev/class": job.size_class}},
        "spec": spec,
    }


# ---------------------------------------------------------------------------------------------
# The pods of an arm


@dataclass
class _Seen:
    created: float = math.nan
    bound: float = math.nan
    node: str = ""
    ended: float = math.nan


@dataclass
class _ArmState:
    """One arm's watch-fed state, shared by its threads under ``lock``."""

    arm: Arm
    index: int
    namespace: str
    templates: Mapping[str, str]  # job -> ResourceClaimTemplate
    lifetimes: Mapping[str, float]
    stand_in: NodeStandIn
    clock: Callable[[], float]  # seconds since the run's start
    seen: dict[str, _Seen] = field(default_factory=dict)
    due: list[tuple[float, str]] = field(default_factory=list)  # (delete at, pod), a heap
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set at the arm's end: what happens later (its pods keep churning until every arm has
    # ended; the clean-up frees room and kube-scheduler binds what still waits) is not the
    # arm's.
    end: float | None = None

    def on_pod(self, _kind: Any, type_: Any, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if name not in self.lifetimes:
            return
        if str(type_) == "DELETED":
            self.stand_in.gone(name)
            return
        node = (obj.get("spec") or {}).get("nodeName")
        if not node:
            return
        claims = tuple(
            c["resourceClaimName"]
            for c in (obj.get("status") or {}).get("resourceClaimStatuses") or []
            if c.get("resourceClaimName")
        )
        with self.lock:
            s = self.seen.setdefault(name, _Seen())
            if not math.isnan(s.bound):
                return
            s.bound, s.node = self.clock(), str(node)
            heapq.heappush(self.due, (s.bound + self.lifetimes[name], name))
        self.stand_in.bound(name, str(node), claims)

    def counts(self) -> tuple[int, int, int]:
        """Jobs created, bound and ended so far."""
        with self.lock:
            values = list(self.seen.values())
        return (
            sum(1 for s in values if not math.isnan(s.created)),
            sum(1 for s in values if not math.isnan(s.bound)),
            sum(1 for s in values if not math.isnan(s.ended)),
        )

    def records(self) -> dict[str, JobRecord]:
        """What the arm saw up to its end, with the workload's node names."""
        prefix = f"a{self.index}-"
        end = math.inf if self.end is None else self.end
        out = {}
        with self.lock:
            for name, s in self.seen.items():
                if math.isnan(s.created) or s.created > end:
                    continue
                bound = None if math.isnan(s.bound) or s.bound > end else s.bound
                ended = None if bound is None or math.isnan(s.ended) or s.ended > end else s.ended
                devices = tuple(
                    dataclasses.replace(d, pool=d.pool.removeprefix(prefix))
                    for d in self.stand_in.devices.get(name, ())
                )
                out[name] = JobRecord(
                    name,
                    s.created,
                    bound,
                    s.node.removeprefix(prefix) if bound is not None else "",
                    devices if bound is not None else (),
                    ended,
                )
        return out


# ---------------------------------------------------------------------------------------------
# The run


class ClusterPacking:
    """One control plane; every arm at once, each on its own copy of the fleet."""

    def __init__(
        self,
        cluster_info: Any,
        workdir: Path,
        workload: Workload,
        arms: Sequence[Arm],
        *,
        settings: ArmSettings = ArmSettings(),
        progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
        client_qps: float | None = 200.0,
    ) -> None:
        from devcluster.cluster import api_client_for
        from process.kube.jsonclient import KubeJson

        if sum(a.carve for a in arms) > 1:
            raise ValueError("at most one carve arm per run")
        self.info = cluster_info
        self.workdir = workdir
        self.workload = workload
        self.arms = list(arms)
        self.settings = settings
        self.say = progress
        self.client_qps = client_qps
        self.admin = api_client_for(Path(cluster_info.kubeconfig))
        self.api = KubeJson(self.admin, request_timeout=60.0)
        self.fleet = GpuFleet(self.admin, DRIVER)
        self.schedulers: dict[str, ArmScheduler] = {}

    # -- set-up --------------------------------------------------------------------------------

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        from process.kube.errors import ApiError

        try:
            return self.api.request("POST", path, body=body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            return {}

    def install(self) -> float:
        """carve's DeviceClasses and admission gate, the native path's DeviceClasses, every
        arm's copy of the fleet and every arm's kube-scheduler; returns the seconds the fleet
        took to grow."""
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
        nodes = [
            n
            for i, arm in enumerate(self.arms)
            for n in fleet_nodes(self.workload.nodes, i, arm.name)
        ]
        took = self.fleet.add(nodes, self.say)
        self.fleet.start()
        # One after the other, from this thread: a kube-scheduler is tied to the thread that
        # starts it (it gets SIGKILL when that thread ends), so never from a pool's.
        for arm in self.arms:
            self.schedulers[arm.name] = ArmScheduler(self.info, arm, self.workdir, self.client_qps)
        return took

    def close(self) -> None:
        """Stop the arms' kube-schedulers and take the fleet away (its Nodes, Leases and
        ResourceSlices), so a control plane shared with other tests is left as found."""
        for s in self.schedulers.values():
            s.stop()
        self.fleet.stop()
        self.fleet.remove()

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

    def _wait_service_account(self, namespace: str) -> None:
        from devcluster.waiting import wait_for

        path = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        wait_for(
            f"the {namespace} namespace's default ServiceAccount",
            lambda: self.api.request("GET", path).get("items"),
        )

    # -- the arms, at once ---------------------------------------------------------------------

    def run(self) -> list[ArmRun]:
        """Every arm at once, from one start; one ArmRun per arm, in the arms' order."""
        from controller.informers import Informer, InformerConfig
        from controller.objects import Kind
        from process.kube.listwatch import JsonCollection
        from tests.support.scale_processes import ControllerUnderTest

        begin = [time.monotonic()]

        def clock() -> float:
            return time.monotonic() - begin[0]

        states: list[_ArmState] = []
        for i, arm in enumerate(self.arms):
            namespace = f"{NAMESPACE_PREFIX}{i}-{arm.name}"
            self._create("/api/v1/namespaces", {"metadata": {"name": namespace}})
            self._wait_service_account(namespace)
            states.append(
                _ArmState(
                    arm,
                    i,
                    namespace,
                    self._templates(namespace, arm),
                    {j.name: j.lifetime for j in self.workload.jobs},
                    NodeStandIn(self.api, namespace, self.settings.destroy_s),
                    clock,
                )
            )
        ctl = None
        carve = next((a for a in self.arms if a.carve), None)
        if carve is not None:
            assert carve.policy is not None
            ctl = ControllerUnderTest(
                Path(self.info.kubeconfig),
                self.workdir / f"controller-{carve.name}.log",
                None,
                extra=(f"--packing-policy={carve.policy.value}",),
            )
            deadline = time.monotonic() + 300
            while not ctl.ready():
                if not ctl.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"carve-controller not ready:\n{ctl.process.log_tail(30)}")
                time.sleep(0.2)
        watchers = []
        for st in states:
            watcher = Informer(
                Kind.POD,
                JsonCollection(self.api, f"/api/v1/namespaces/{st.namespace}/pods"),
                st.on_pod,
                lambda _k: None,
                InformerConfig(watch_timeout_s=120, resync_period_s=None),
            )
            threading.Thread(target=watcher.run, args=(time.monotonic,), daemon=True).start()
            watchers.append(watcher)
        while not all(w.has_synced for w in watchers):
            time.sleep(0.05)
        work0 = {name: s.work() for name, s in self.schedulers.items()}
        cpu0 = ctl.cpu_s() if ctl is not None else math.nan
        work1: dict[str, SchedulerWork] = {}
        cpu1 = math.nan
        stop = threading.Event()
        threads: list[threading.Thread] = []
        left: dict[str, str] = {}  # namespace -> what of it outlived the clean-up
        try:
            begin[0] = time.monotonic()
            for st in states:
                threads += [
                    threading.Thread(target=self._create_pods, args=(st, w, stop), daemon=True)
                    for w in range(self.settings.creators)
                ]
                threads.append(
                    threading.Thread(target=self._delete_due, args=(st, stop), daemon=True)
                )
            for t in threads:
                t.start()
            self._watch_until_done(states, ctl, clock)
            work1 = {name: s.work() for name, s in self.schedulers.items()}
            cpu1 = ctl.cpu_s() if ctl is not None else math.nan
            stop.set()
            for t in threads:
                t.join(timeout=30)
        finally:
            stop.set()
            for st in states:
                if st.end is None:
                    st.end = clock()
            try:
                left = self._clean_up([st.namespace for st in states], ctl)
            except Exception as exc:  # the figures were recorded already: keep them
                self.say(f"warning: the clean-up failed, objects may be left behind: {exc!r}")
                left = {st.namespace: "unknown, the clean-up failed" for st in states}
            for st in states:
                st.stand_in.stop()
            for w in watchers:
                w.stop()
            if ctl is not None:
                ctl.stop()
        return [
            self._arm_run(st, left.get(st.namespace), work0, work1, cpu1 - cpu0) for st in states
        ]

    def _arm_run(
        self,
        st: _ArmState,
        left: str | None,
        work0: Mapping[str, SchedulerWork],
        work1: Mapping[str, SchedulerWork],
        carve_cpu_s: float,
    ) -> ArmRun:
        records = st.records()
        notes: list[str] = []
        if left is not None:
            notes.append(f"pods or claims were left behind after the run: {left}")
        if st.stand_in.late:
            notes.append(
                f"{st.stand_in.late} claims were gone before the node stand-in got to them"
            )
        if st.stand_in.errors:
            notes.append(f"{len(st.stand_in.errors)} stand-in errors, e.g. {st.stand_in.errors[0]}")
        scheduled = math.nan
        if st.arm.name in work1:
            before, after = work0[st.arm.name], work1[st.arm.name]
            notes.append(after.since(before))
            scheduled = after.scheduled - before.scheduled
        if st.arm.carve:
            notes.append(f"carve-controller: {carve_cpu_s:.0f} CPU seconds")
        lags = sorted(
            r.created - j.arrival for j in self.workload.jobs if (r := records.get(j.name))
        )
        lag = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else math.nan
        assert st.end is not None
        return ArmRun(
            st.arm.name,
            records,
            st.end,
            lag,
            frozenset(st.stand_in.carve_allocated),
            (st.stand_in.finalizers_added, st.stand_in.finalizers_removed),
            scheduled,
            tuple(notes),
        )

    def _create_pods(self, st: _ArmState, worker: int, stop: threading.Event) -> None:
        from process.kube.errors import ApiError

        jobs = self.workload.jobs
        for i in range(worker, len(jobs), self.settings.creators):
            job = jobs[i]
            delay = job.arrival - st.clock()
            if delay > 0 and stop.wait(delay):
                return
            if stop.is_set():
                return
            try:
                self.api.request(
                    "POST",
                    f"/api/v1/namespaces/{st.namespace}/pods",
                    body=pod_manifest(job, st.templates[job.name], st.arm),
                )
            except ApiError as exc:
                self.say(f"[{st.arm.name}] creating {job.name} failed: {exc}")
                continue
            with st.lock:
                st.seen.setdefault(job.name, _Seen()).created = st.clock()

    def _delete_due(self, st: _ArmState, stop: threading.Event) -> None:
        from process.kube.errors import ApiError

        def delete(name: str) -> None:
            with contextlib.suppress(ApiError):
                self.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{st.namespace}/pods/{name}",
                    body={"gracePeriodSeconds": 0},
                )

        with ThreadPoolExecutor(2) as pool:
            while not stop.is_set():
                due: list[str] = []
                with st.lock:
                    now = st.clock()
                    while st.due and st.due[0][0] <= now:
                        _, name = heapq.heappop(st.due)
                        st.seen[name].ended = now
                        due.append(name)
                list(pool.map(delete, due))
                stop.wait(0.1)

    def _watch_until_done(
        self, states: Sequence[_ArmState], ctl: Any, clock: Callable[[], float]
    ) -> None:
        """Until every arm has ended: all its jobs bound, or the drain is over."""
        jobs = len(self.workload.jobs)
        deadline = self.workload.last_arrival + self.settings.drain_s
        next_say = self.settings.progress_s
        while any(st.end is None for st in states):
            now = clock()
            for st in states:
                if st.end is not None:
                    continue
                created, bound, _ = st.counts()
                if created == jobs and bound == jobs:
                    st.end = now
                    self.say(f"[{st.arm.name}] {now:.0f}s: all {bound} jobs bound")
                elif now > deadline:
                    st.end = now
                    self.say(
                        f"[{st.arm.name}] {now:.0f}s: drain over ({self.settings.drain_s:g}s "
                        f"after the last arrival); {jobs - bound} jobs never bound"
                    )
            if ctl is not None and not ctl.alive():
                raise RuntimeError(f"carve-controller exited:\n{ctl.process.log_tail(30)}")
            if now >= next_say:
                next_say += self.settings.progress_s
                parts = []
                for st in states:
                    created, bound, ended = st.counts()
                    parts.append(
                        f"{st.arm.name} {created}/{bound}/{bound - ended}/{created - bound}"
                    )
                self.say(f"{now:.0f}s (created/bound/running/waiting): " + ", ".join(parts))
            time.sleep(0.2)

    def _clean_up(self, namespaces: Sequence[str], ctl: Any) -> dict[str, str]:
        """Delete the arms' pods and wait for their claims to go (the stand-ins drop their
        finalizers, carve's controller its own); what is left of each namespace that is not
        empty when the wait ends.

        The pods' deletion is asked again while some remain: on a control plane still busy
        with the arms, one collection delete of thousands of pods can outlive its request,
        and the server stops deleting when the client gives up."""
        deadline = time.monotonic() + self.settings.cleanup_s
        left = list(namespaces)
        asked: dict[str, float] = {}
        while left and time.monotonic() < deadline:
            for ns in list(left):
                pods = self.api.request(
                    "GET", f"/api/v1/namespaces/{ns}/pods", query=[("limit", "1")]
                )
                claims = self.api.request(
                    "GET",
                    f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
                    query=[("limit", "1")],
                )
                if not pods.get("items") and not claims.get("items"):
                    left.remove(ns)
                elif pods.get("items") and time.monotonic() - asked.get(ns, -1e9) > 15:
                    asked[ns] = time.monotonic()
                    self._delete_pods(ns)
            if ctl is not None and not ctl.alive():
                break
            if left:
                time.sleep(0.5)
        out = {ns: self._what_is_left(ns) for ns in left}
        for ns, what in out.items():
            self.say(f"warning: left behind in {ns} after the clean-up: {what}")
        return out

    def _delete_pods(self, namespace: str) -> None:
        import urllib3

        from process.kube.errors import ApiError

        try:
            self.api.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods",
                query=[("gracePeriodSeconds", "0")],
                body={},
                timeout=120,
            )
        except (ApiError, urllib3.exceptions.HTTPError) as exc:
            self.say(f"clean-up: deleting the pods of {namespace} failed, asking again: {exc}")

    def _what_is_left(self, namespace: str) -> str:
        pods = self.api.request("GET", f"/api/v1/namespaces/{namespace}/pods").get("items") or []
        claims_path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        claims = self.api.request("GET", claims_path).get("items") or []
        return leftovers(pods, claims)


_FINALIZERS_SHOWN = 3
"""A node stand-in's finalizer names its node: a hundred of them would drown the note."""


def leftovers(pods: Sequence[Mapping[str, Any]], claims: Sequence[Mapping[str, Any]]) -> str:
    """What a clean-up left of an arm, and how far its deletion got: a claim still allocated,
    or still carrying a finalizer, says which side did not let go."""
    claim_views = [ClaimView(c) for c in claims]
    terminating_pods = sum(1 for p in pods if ObjectView(p).deleting)
    terminating_claims = sum(1 for c in claim_views if c.deleting)
    allocated = sum(1 for c in claim_views if c.allocated)
    finalizers = Counter(f for c in claim_views for f in c.finalizers)
    ranked = sorted(finalizers.items(), key=lambda item: (-item[1], item[0]))
    held = "".join(f"; {n} with {f}" for f, n in ranked[:_FINALIZERS_SHOWN])
    if len(ranked) > _FINALIZERS_SHOWN:
        held += f"; {len(ranked) - _FINALIZERS_SHOWN} other finalizers"
    return (
        f"{len(pods)} pods ({terminating_pods} terminating), {len(claims)} claims "
        f"({allocated} allocated, {terminating_claims} terminating{held})"
    )
