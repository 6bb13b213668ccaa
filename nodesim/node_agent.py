"""The kubelet's DRA part for one simulated node, done for real against real processes.

For every pod bound to the node (spec.nodeName) a worker does what the kubelet does around DRA:
prepare the pod's claims through the registered plugin (NodePrepareResources over its unix
socket), check that every CDI device ID it returns resolves to a spec on disk, record the
container edits the runtime would apply, post the pod's status (Running; Succeeded or Failed
when the containers "exit"; Failed with the plugin's message when prepare keeps failing),
and unprepare (NodeUnprepareResources) when the pod ends. A graceful deletion completes only
after unprepare: the agent then deletes the pod with grace period 0, as the kubelet does.

A claim shared by several pods on the node is unprepared when its last pod ends. Plugin
(re-)registration follows the registration socket: a re-created socket (a restarted plugin)
is registered again, like the kubelet's plugin watcher does.

Test tooling; not part of the carve distribution.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from controller.informers import Informer, InformerConfig
from controller.objects import EventType, Kind
from nodesim.kubelet import KubeletSim, RegisteredPlugin
from nodesim.lifecycle import (
    CdiResolutionError,
    ClaimsNotReadyError,
    ContainerEdits,
    Obj,
    PodClaim,
    PodSpecError,
    claim_names,
    exit_code,
    failed_to_start_status,
    finished_status,
    is_deleting,
    is_terminal,
    load_cdi_specs,
    pod_claims,
    pod_key,
    resolve_cdi,
    run_seconds,
    running_status,
)
from process.kube.errors import ApiError
from process.kube.jsonclient import KubeJson
from process.kube.listwatch import JsonCollection

_log = logging.getLogger(__name__)
_STRATEGIC = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class AgentSettings:
    node_name: str
    cdi_roots: tuple[Path, ...]
    # Where each started pod's container edits are written as JSON (for people and tests).
    containers_dir: Path | None = None
    # A prepare that fails this many times in a row fails the pod (the kubelet would retry
    # forever; a test wants an answer). Plugin-unavailable and claims-not-ready do not count.
    prepare_attempts: int = 6
    backoff_base_s: float = 0.25
    backoff_max_s: float = 5.0
    plugin_poll_s: float = 0.25


class PrepareFailedError(Exception):
    """The plugin answered, with an error for at least one claim."""


class PluginUnavailableError(Exception):
    """No plugin registered for a driver, or its socket does not answer (restarting)."""


@dataclass
class PodRecord:
    """What the agent knows about one pod; read by tests and the latency benchmark."""

    uid: str
    namespace: str
    name: str
    prepared: list[PodClaim] = field(default_factory=list)
    edits: ContainerEdits | None = None
    started_at: dt.datetime | None = None
    started_mono: float | None = None
    finished: bool = False
    failed_attempts: int = 0
    next_attempt: float = 0.0
    last_error: str = ""
    # Wall-clock seconds (time.time()) of the steps, for the latency breakdown.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class _Worker:
    def __init__(self, record: PodRecord) -> None:
        self.record = record
        self.latest: Obj | None = None
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None


class NodeAgent:
    """Runs the DRA side of one node's kubelet until `stop()`."""

    def __init__(
        self,
        api_client: Any,
        kubelet: KubeletSim,
        settings: AgentSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:

        self.settings = settings
        self.kubelet = kubelet
        self._api = KubeJson(api_client, request_timeout=30.0)
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self.records: dict[str, PodRecord] = {}  # pod uid -> record (kept after the pod ends)
        self._claim_users: dict[str, set[str]] = {}  # claim uid -> pod uids holding it prepared
        self._claim_locks: dict[str, threading.Lock] = {}
        self._informer = Informer(
            Kind.POD,
            JsonCollection(
                self._api,
                "/api/v1/pods",
                [("fieldSelector", f"spec.nodeName={settings.node_name}")],
            ),
            self._on_pod,
            lambda _kind: None,
            InformerConfig(watch_timeout_s=60, resync_period_s=60.0, backoff_max_s=2.0),
        )
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        self._poll_plugins()
        for target, name in (
            (lambda: self._informer.run(self._clock), "pods"),
            (self._plugin_watcher, "plugins"),
        ):
            t = threading.Thread(
                target=target, name=f"nodesim-{self.settings.node_name}-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._informer.stop()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.wake.set()
        for t in self._threads:
            t.join(timeout=5)
        for w in workers:
            if w.thread is not None:
                w.thread.join(timeout=5)

    def record_of(self, namespace: str, name: str) -> PodRecord | None:
        with self._lock:
            for rec in self.records.values():
                if rec.namespace == namespace and rec.name == name:
                    return rec
        return None

    # -- plugin registration -----------------------------------------------------------------

    def _plugin_watcher(self) -> None:
        while not self._stop.wait(self.settings.plugin_poll_s):
            try:
                self._poll_plugins()
            except Exception:
                _log.exception("plugin watcher pass failed")

    def _poll_plugins(self) -> None:
        """One plugin-watcher pass; pods waiting for a plugin retry once one is registered."""
        if self.kubelet.scan():
            self._wake_all()

    def _plugin(self, driver: str) -> RegisteredPlugin:
        plugin = self.kubelet.plugins.get(driver)
        if plugin is None:
            raise PluginUnavailableError(f"DRA driver {driver} is not registered on this node")
        return plugin

    # -- pod events --------------------------------------------------------------------------

    def _on_pod(self, _kind: Kind, type_: EventType, pod: Obj) -> None:
        uid = str(pod.get("metadata", {}).get("uid", ""))
        with self._lock:
            worker = self._workers.get(uid)
            if worker is None:
                if type_ == EventType.DELETED:
                    return  # never seen alive here: nothing to clean up
                meta = pod.get("metadata", {})
                record = PodRecord(uid, str(meta.get("namespace")), str(meta.get("name")))
                record.timings["seen"] = time.time()
                worker = _Worker(record)
                self._workers[uid] = worker
                self.records[uid] = record
                worker.thread = threading.Thread(
                    target=self._run_worker, args=(worker,), name=f"pod-{record.key}", daemon=True
                )
                start = True
            else:
                start = False
            worker.latest = None if type_ == EventType.DELETED else pod
        worker.wake.set()
        if start and worker.thread is not None:
            worker.thread.start()

    def _wake_all(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.wake.set()

    # -- per-pod worker ----------------------------------------------------------------------

    def _run_worker(self, worker: _Worker) -> None:
        rec = worker.record
        failures = 0
        while not self._stop.is_set():
            worker.wake.clear()
            with self._lock:
                pod = worker.latest
            try:
                wait = self._step(rec, pod)
                failures = 0
            except Exception as exc:
                failures += 1
                wait = self._backoff(failures)
                rec.last_error = str(exc)
                _log.warning("pod %s: %s; retrying in %.1fs", rec.key, exc, wait)
            if wait is not None and wait < 0:
                break  # the pod is gone for good
            worker.wake.wait(wait)
        with self._lock:
            if self._workers.get(rec.uid) is worker:
                del self._workers[rec.uid]

    def _backoff(self, n: int) -> float:
        base = self.settings.backoff_base_s * 2.0 ** max(0, n - 1)
        return min(self.settings.backoff_max_s, base) * random.uniform(0.75, 1.25)

    def _step(self, rec: PodRecord, pod: Obj | None) -> float | None:
        """One decision; returns how long to sleep (None = until woken, _DONE = finished)."""
        if pod is None:
            # The object is gone (deleted with grace 0 by someone): clean up what it held.
            self._release(rec)
            return _DONE
        if is_deleting(pod):
            self._release(rec)
            self._delete_now(pod)
            return None  # wait for the DELETED event
        if is_terminal(pod):
            rec.finished = True
            self._release(rec)
            return None
        now = self._clock()
        if rec.started_mono is None:
            if now < rec.next_attempt:
                return max(0.0, rec.next_attempt - now)
            return self._try_start(rec, pod)
        try:
            duration = run_seconds(pod)
        except PodSpecError:
            duration = None  # already reported when the pod started
        if duration is None:
            return None
        ends = rec.started_mono + duration
        if now < ends:
            return max(0.0, ends - now)
        self._finish(rec, pod)
        return None

    def _try_start(self, rec: PodRecord, pod: Obj) -> float | None:
        try:
            run_seconds(pod)
            exit_code(pod)
            claims = self._read_claims(pod)
            rec.timings.setdefault("claims_ready", time.time())
            self._prepare(rec, claims)
        except (ClaimsNotReadyError, PluginUnavailableError) as exc:
            rec.last_error = str(exc)
            _log.debug("pod %s not startable yet: %s", rec.key, exc)
            rec.next_attempt = self._clock() + 0.2
            return 0.2
        except (PrepareFailedError, CdiResolutionError, PodSpecError) as exc:
            rec.failed_attempts += 1
            rec.last_error = str(exc)
            permanent = isinstance(exc, PodSpecError)
            self._event(pod, "Warning", "FailedPrepareDynamicResources", str(exc))
            if permanent or rec.failed_attempts >= self.settings.prepare_attempts:
                _log.warning("pod %s failed: %s", rec.key, exc)
                self._release(rec)
                self._patch_status(pod, failed_to_start_status(pod, _utcnow(), str(exc)))
                rec.finished = True
                rec.started_mono = self._clock()  # no further start attempts
                return None
            delay = self._backoff(rec.failed_attempts)
            rec.next_attempt = self._clock() + delay
            _log.info("pod %s: prepare failed (%s); retry in %.1fs", rec.key, exc, delay)
            return delay
        started = _utcnow()
        self._patch_status(pod, running_status(pod, started))
        rec.started_at = started
        rec.started_mono = self._clock()
        rec.timings["running"] = time.time()
        self._write_container_record(rec, pod)
        _log.info("pod %s running with %s", rec.key, rec.edits.cdi_ids if rec.edits else ())
        return 0.0

    def _finish(self, rec: PodRecord, pod: Obj) -> None:
        assert rec.started_at is not None
        code = exit_code(pod)
        self._patch_status(pod, finished_status(pod, rec.started_at, _utcnow(), code))
        rec.finished = True
        rec.timings["finished"] = time.time()
        self._release(rec)

    # -- claims ------------------------------------------------------------------------------

    def _read_claims(self, pod: Obj) -> list[PodClaim]:
        namespace = str(pod["metadata"]["namespace"])
        objects: dict[str, Obj] = {}
        for _entry, name in claim_names(pod):
            if name is None or name in objects:
                continue
            try:
                objects[name] = self._api.request(
                    "GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
                )
            except ApiError as exc:
                if exc.status != 404:
                    raise
        return pod_claims(pod, objects)

    @contextmanager
    def _locked_claims(self, uids: Sequence[str]) -> Iterator[None]:
        with self._lock:
            locks = [self._claim_locks.setdefault(u, threading.Lock()) for u in sorted(set(uids))]
        with ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def _prepare(self, rec: PodRecord, claims: Sequence[PodClaim]) -> None:
        by_driver: dict[str, list[PodClaim]] = {}
        for c in claims:
            if not c.drivers:
                continue
            if len(c.drivers) > 1:
                raise PodSpecError(
                    f"claim {c.ref.name} has results of several drivers {list(c.drivers)}; "
                    "the simulated node supports one driver per claim"
                )
            by_driver.setdefault(c.drivers[0], []).append(c)
        refs: list[str] = []
        with self._locked_claims([c.ref.uid for c in claims]):
            rec.timings.setdefault("prepare_start", time.time())
            for driver, group in by_driver.items():
                plugin = self._plugin(driver)
                try:
                    results = plugin.prepare([c.ref for c in group])
                except grpc.RpcError as exc:
                    raise self._rpc_problem("NodePrepareResources", driver, exc) from exc
                errors = []
                for c in group:
                    result = results.get(c.ref.uid)
                    if result is None:
                        errors.append(f"claim {c.ref.name}: the plugin returned no result")
                    elif result.error:
                        errors.append(f"claim {c.ref.name}: {result.error}")
                    else:
                        for device in result.devices:
                            refs.extend(device.cdi_device_ids)
                        self._hold(rec, c)
                if errors:
                    raise PrepareFailedError("; ".join(errors))
            rec.timings["prepare_end"] = time.time()
        rec.edits = resolve_cdi(refs, load_cdi_specs(self.settings.cdi_roots))

    def _hold(self, rec: PodRecord, claim: PodClaim) -> None:
        with self._lock:
            self._claim_users.setdefault(claim.ref.uid, set()).add(rec.uid)
        if all(p.ref.uid != claim.ref.uid for p in rec.prepared):
            rec.prepared.append(claim)

    def _release(self, rec: PodRecord) -> None:
        """Unprepare the pod's claims that no other pod on the node still uses."""
        if not rec.prepared:
            return
        with self._locked_claims([c.ref.uid for c in rec.prepared]):
            last: list[PodClaim] = []
            with self._lock:
                for c in rec.prepared:
                    others = self._claim_users.get(c.ref.uid, set()) - {rec.uid}
                    if others:
                        self._claim_users[c.ref.uid] = others
                    else:
                        last.append(c)
            rec.prepared = list(last)
            by_driver: dict[str, list[PodClaim]] = {}
            for c in last:
                by_driver.setdefault(c.drivers[0], []).append(c)
            errors = []
            for driver, group in by_driver.items():
                plugin = self._plugin(driver)
                try:
                    results = plugin.unprepare([c.ref for c in group])
                except grpc.RpcError as exc:
                    raise self._rpc_problem("NodeUnprepareResources", driver, exc) from exc
                for c in group:
                    error = results.get(c.ref.uid, "the plugin returned no result")
                    if error:
                        errors.append(f"claim {c.ref.name}: {error}")
                        continue
                    with self._lock:
                        self._claim_users.pop(c.ref.uid, None)
                    rec.prepared.remove(c)
            if errors:
                raise PrepareFailedError("unprepare failed: " + "; ".join(errors))
        rec.timings["unprepared"] = time.time()

    @staticmethod
    def _rpc_problem(call: str, driver: str, exc: grpc.RpcError) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return PluginUnavailableError(f"{call} to {driver}: plugin unavailable ({detail})")
        return PrepareFailedError(f"{call} to {driver} failed: {code}: {detail}")

    # -- API writes --------------------------------------------------------------------------

    def _patch_status(self, pod: Obj, body: Obj) -> None:
        meta = pod["metadata"]
        body = {"metadata": {"uid": meta["uid"]}, **body}
        self._api.request(
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            body=body,
            content_type=_STRATEGIC,
        )

    def _delete_now(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            self._api.request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": meta["uid"]},
                },
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _event(self, pod: Obj, type_: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = _utcnow()
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "kubelet", "host": self.settings.node_name},
            "reportingComponent": "kubelet",
            "reportingInstance": self.settings.node_name,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self._api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body=body)
        except Exception as exc:  # events are best effort, as in the kubelet
            _log.debug("event for %s not recorded: %s", pod_key(pod), exc)

    def _write_container_record(self, rec: PodRecord, pod: Obj) -> None:
        directory = self.settings.containers_dir
        if directory is None or rec.edits is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        data: Mapping[str, Any] = {
            "pod": rec.key,
            "uid": rec.uid,
            "node": self.settings.node_name,
            "claims": [
                {"entry": c.entry, "name": c.ref.name, "uid": c.ref.uid} for c in rec.prepared
            ],
            "containers": [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []],
            "edits": rec.edits.to_json(),
        }
        path = directory / f"{rec.namespace}_{rec.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)


_DONE = -1.0  # returned by _step when the worker's pod is gone for good (any negative wait)


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
