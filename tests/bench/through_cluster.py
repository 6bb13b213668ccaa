"""A shortened stretch of the trace through the real control plane (bench/trace_e2e.py).

:func:`shorten` makes the jobs; :func:`run_path` runs them on simulated nodes through either
carve-controller or kube-scheduler's native path and stamps when each pod was bound; see
bench/trace_e2e.py for what is measured and how it compares with the in-process replay.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.placement import DEFAULT_POLICY
from tests.bench.alibaba import DRIVER, GPU_CLASS, MIG_CLASS, TraceNode, TraceTask, catalogue_model
from tests.bench.queued import percentile
from tests.bench.replay import Job, build_jobs

NATIVE_CLASSES = {MIG_CLASS: "bench-native-mig", GPU_CLASS: "bench-native-gpu"}
"""carve's DeviceClass -> the class outside carve's set that the native path's claims use."""
CONTROLLER_POLICY = DEFAULT_POLICY
"""The policy carve-controller runs with (controller.main builds EnginePlanner's default)."""


# ---------------------------------------------------------------------------------------------
# Jobs


@dataclass(frozen=True)
class Shortening:
    jobs: int = 40
    span: float = 60.0  # seconds over which the stretch arrives
    median_run: float = 20.0
    min_run: float = 3.0
    max_run: float = 60.0
    offset: float = 0.3  # where the stretch starts in the trace's timeline (0 to 1)


def shorten(
    tasks: Sequence[TraceTask], nodes: Sequence[TraceNode], how: Shortening
) -> tuple[list[Job], float]:
    """The jobs of the run, on wall-clock seconds from 0, and the arrival compression (trace
    seconds per wall second)."""
    timeline = build_jobs(tasks, nodes, mode="timeline")
    if len(timeline) < how.jobs:
        raise ValueError(f"the trace has only {len(timeline)} timed jobs for these nodes")
    start = min(int(how.offset * len(timeline)), len(timeline) - how.jobs)
    stretch = timeline[start : start + how.jobs]
    t0 = stretch[0].arrival
    arrival_range = max(1e-9, stretch[-1].arrival - t0)
    compression = arrival_range / how.span
    lifetimes = [(j.departure or j.arrival) - j.arrival for j in stretch]
    median = statistics.median(lifetimes) or 1.0
    scale = how.median_run / median
    out = []
    for i, (job, life) in enumerate(zip(stretch, lifetimes, strict=True)):
        arrival = round((job.arrival - t0) / compression, 3)
        run = round(min(how.max_run, max(how.min_run, life * scale)), 3)
        out.append(
            dataclasses.replace(job, pod=f"j{i:03d}", arrival=arrival, departure=arrival + run)
        )
    return out, compression


def native_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The same claim with DeviceClasses outside carve's set (so carve's gate leaves it)."""
    out: dict[str, Any] = json.loads(json.dumps(spec))
    for request in out["devices"]["requests"]:
        exactly = request["exactly"]
        exactly["deviceClassName"] = NATIVE_CLASSES[exactly["deviceClassName"]]
    return out


# ---------------------------------------------------------------------------------------------
# One path through the control plane


@dataclass
class PathFigures:
    name: str
    jobs: int = 0
    placed: int = 0  # bound by the last arrival
    share_asked: float = 0.0
    share_placed: float = 0.0
    bound: int = 0  # bound at any time before the run ended
    finished: int = 0
    wait_p50: float = 0.0
    wait_p99: float = 0.0
    wait_mean: float = 0.0
    wall_s: float = 0.0
    notes: str = ""


def native_classes(stack: Any) -> None:
    """The native path's DeviceClasses (idempotent)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api: Any = client.ResourceV1Api(stack.api)
    for kind, name in (("mig", NATIVE_CLASSES[MIG_CLASS]), ("gpu", NATIVE_CLASSES[GPU_CLASS])):
        expression = (
            f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "{kind}"'
        )
        try:
            api.create_device_class(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": name},
                    "spec": {"selectors": [{"cel": {"expression": expression}}]},
                }
            )
        except ApiException as exc:
            if exc.status != 409:
                raise


def run_path(
    stack: Any,
    nodes: Sequence[TraceNode],
    jobs: Sequence[Job],
    *,
    native: bool,
    poll: float = 0.3,
    grace: float = 120.0,
    expect_never: frozenset[str] = frozenset(),
    env: Any = None,
) -> PathFigures:
    """Create the jobs' pods on schedule in a namespace of their own, on fresh nodes, and watch
    them until every pod that can run has finished (or ``grace`` seconds after the last job
    should have ended). ``expect_never``: pods the in-process replay could place nowhere, not
    waited for. ``env``: an existing tests.e2e.harness.E2E to use (a test's fixture); else one
    is made here and torn down after."""
    from kubernetes import client

    from tests.e2e.harness import E2E, GATED_NAMESPACES

    own = env is None
    if env is None:
        env = E2E(
            stack, "trace-native" if native else "trace-carve", {} if native else GATED_NAMESPACES
        )
    name = (
        "kube-scheduler native path" if native else f"carve-controller ({CONTROLLER_POLICY.value})"
    )
    figures = PathFigures(name)
    try:
        for i, n in enumerate(nodes):
            gpus = (catalogue_model(n.model).key,) * n.gpus
            env.node(f"n{i}", *gpus, cpu=f"{n.cpu_milli}m", memory=f"{n.memory_mib}Mi")
        resource: Any = client.ResourceV1Api(stack.api)
        templates: dict[str, str] = {}
        for job in jobs:
            key = json.dumps(job.spec, sort_keys=True)
            if key in templates:
                continue
            tname = templates[key] = f"t{len(templates):02d}"
            spec = native_spec(job.spec) if native else dict(job.spec)
            resource.create_namespaced_resource_claim_template(
                env.namespace,
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": tname},
                    "spec": {"spec": spec},
                },
            )
            if not native:
                env.wait_gate_sees({"resourceClaimTemplateName": tname})
        created: dict[str, float] = {}
        bound: dict[str, float] = {}
        finished: dict[str, float] = {}
        by_pod = {job.pod: job for job in jobs}
        pending = sorted(jobs, key=lambda j: j.arrival)
        begin = time.monotonic()
        last_end = max((j.departure or j.arrival) for j in jobs)
        deadline = begin + last_end + grace
        next_poll = begin
        while time.monotonic() < deadline:
            now = time.monotonic() - begin
            while pending and pending[0].arrival <= now:
                job = pending.pop(0)
                template = templates[json.dumps(job.spec, sort_keys=True)]
                run = (job.departure or job.arrival) - job.arrival
                env.pod(
                    job.pod,
                    {"gpu": {"resourceClaimTemplateName": template}},
                    run_seconds=run,
                    cpu=f"{job.needs.requests.cpu_milli}m",
                    memory=f"{job.needs.requests.memory // 2**20}Mi",
                )
                created[job.pod] = time.monotonic() - begin
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + poll
                stamp = time.monotonic() - begin
                for pod in env.core.list_namespaced_pod(env.namespace).items:
                    pname = pod.metadata.name
                    if pod.spec.node_name and pname not in bound:
                        bound[pname] = stamp
                    if pod.status and pod.status.phase in ("Succeeded", "Failed"):
                        finished.setdefault(pname, stamp)
                waiting_for = set(by_pod) - set(finished) - expect_never
                if not pending and not waiting_for:
                    break
            time.sleep(0.05)
        figures.wall_s = time.monotonic() - begin
        horizon = max(j.arrival for j in jobs)
        waits = [bound[p] - created[p] for p in bound if p in created]
        figures.jobs = len(jobs)
        figures.share_asked = sum(j.request.share for j in jobs)
        for pod, t in bound.items():
            if t <= horizon + poll:
                figures.placed += 1
                figures.share_placed += by_pod[pod].request.share
        figures.bound = len(bound)
        figures.finished = len(finished)
        figures.wait_p50 = percentile(waits, 0.50)
        figures.wait_p99 = percentile(waits, 0.99)
        figures.wait_mean = statistics.fmean(waits) if waits else 0.0
        last = env.core.list_namespaced_pod(env.namespace).items
        failed = [p.metadata.name for p in last if p.status and p.status.phase == "Failed"]
        notes = [f"{len(finished)} finished", f"{len(bound)} bound"]
        unbound = [p for p in last if p.metadata.name in created and p.metadata.name not in bound]
        if unbound:
            notes.append(f"never bound: {_why_unbound(unbound)}")
        if failed:
            notes.append(f"{len(failed)} failed: {', '.join(sorted(failed)[:5])}")
        problems = env.check_invariants()
        if problems:
            notes.append(f"invariant problems: {problems[:3]}")
        figures.notes = "; ".join(notes)
        return figures
    finally:
        if own:
            problems = env.teardown()
            if problems:
                print(f"teardown problems ({name}): {problems[0][:500]}", file=sys.stderr)


def _why_unbound(pods: Sequence[Any]) -> str:
    """Each pod that never bound, with its conditions' messages: what a failed run needs to
    tell a slow release from a stuck one."""
    out = []
    for pod in pods[:5]:
        told = [
            f"{c.type}={c.status} {c.reason or ''} {c.message or ''}".strip()
            for c in (pod.status.conditions if pod.status else None) or []
        ]
        gates = [g.name for g in pod.spec.scheduling_gates or []]
        out.append(f"{pod.metadata.name} (gates {gates}; {'; '.join(told) or 'no conditions'})")
    return ", ".join(out)
