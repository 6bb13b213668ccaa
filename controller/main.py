"""`carve-controller`: the central allocator process.

Flags come from `process.flags`: every one has its environment twin `CARVE_<FLAG>` (dashes as
underscores), so the Deployment can be configured either way; flags win over the environment.
Those shared with `carve-kubelet-plugin` (kubeconfig, driver name, ops address, logging, resync
period) are declared there once; a bad value exits 2 with the flag and an example.

Process shape: six informer threads feed one reconciler thread, which makes every decision;
the writes that carry them (placements, releases) and the events and pod conditions run on
write pools beside it (`controller.writepool`); a leader-election thread gates the reconciler
(followers keep their caches warm, so a failover decides on a full picture at once but still
only after its informers have listed); an HTTP thread serves /metrics, /healthz and /readyz.
Losing the lease ends the process (exit code 3): a restart is the simplest way to be sure that
no decision of the old term survives into the next.
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.config import ReconcilerConfig
from controller.events import KubeRecorder
from controller.informers import Informer, InformerConfig, standard_informers, start_informers
from controller.leader import LeaderElector, LeaseConfig
from controller.liveness import LoopLiveness
from controller.metrics import ControllerMetrics
from controller.namespaceshare import DEFAULT_SHARE, NamespaceShare, Refetcher, ShedReport
from controller.objects import CarveClasses, Kind
from controller.placement import DEFAULT_POLICY, Policy
from controller.reconciler import Reconciler
from controller.seams import Planner, PreemptionHook
from controller.status import KubeClaimWriter
from controller.writepool import DeferredRecorder, WritePool
from driver.contract import Contract
from process import flags
from process.entrypoint import start_logging, stop_on_signals, usage_exit
from process.flags import Flag, UsageError
from process.kube.jsonclient import KubeJson
from process.kube.requestcount import count_requests
from process.kubeconfig import KubeconfigError, load_api_client
from process.opshttp import OpsServer

_log = logging.getLogger("carve.controller")

PROG = "carve-controller"
_USAGE_KINDS = (Kind.SLICE, Kind.CLAIM)
EXIT_LOST_LEASE = 3

# -- flags -------------------------------------------------------------------------------------

DEVICE_CLASSES: Flag[frozenset[str] | None] = Flag(
    "device-classes",
    "comma-separated DeviceClass names that are carve's, besides every '*.<driver>' class "
    "(default: <driver> and its whole-GPU class, e.g. mig.carve.dev,gpu.carve.dev)",
    "",
    flags.comma_set,
    example="mig.carve.dev,gpu.carve.dev",
)
NATIVE_FALLBACK_AFTER: Flag[float | None] = Flag(
    "native-fallback-after",
    "ungate pods unplaceable for this long so kube-scheduler handles them (off when empty)",
    "",
    flags.optional_duration,
    example="10m",
    metavar="DURATION",
)


def _loss_grace(text: str) -> float:
    if text.strip().startswith("-"):
        raise ValueError("must be 0 (signal off) or a positive duration")
    return flags.parse_duration(text)


NODE_LOSS_GRACE: Flag[float] = Flag(
    "node-loss-grace",
    "a node NotReady/unreachable this long counts as lost: no new placements there and its "
    "unbound pods are placed elsewhere (0 turns this signal off; deleted and out-of-service "
    "nodes are lost at once)",
    "5m",
    _loss_grace,
    example="5m",
    metavar="DURATION",
)
PREEMPTION = flags.switch(
    "preemption",
    "evict the cheapest set of lower-priority pods whose MIG slices let an unplaceable pod fit "
    "(through the Eviction API, honouring PodDisruptionBudgets)",
    default=True,
)
PREEMPTION_HOLD = flags.duration(
    "preemption-hold",
    "how long slices freed by preemption are held for the preemptor before others may use them",
    "5m",
)
HOLD_GATE_UNTIL_CARVED = flags.switch(
    "hold-gate-until-carved",
    "for devices with binding conditions (plugins with --binding-conditions): remove the "
    "scheduling gate only once the node reports the devices carved, so kube-scheduler binds at "
    "its first check instead of polling every 5s; a failed carve is placed again at once",
    default=True,
)
CARVE_WAIT = flags.duration(
    "carve-wait",
    "with --hold-gate-until-carved: how long a pod stays gated waiting for its node to report "
    "the carve; then it is ungated and kube-scheduler's own wait takes over",
    "30s",
)


def _workers(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if not 0 <= value <= 64:
        raise ValueError("must be a whole number from 0 (write on the decision thread) to 64")
    return value


COMMIT_WORKERS: Flag[int] = Flag(
    "commit-workers",
    "threads that write placements (allocation, gate, event) while the next pod is "
    "decided; each placement is assumed in the model until its writes land, and a failed one "
    "is placed again (0: write each placement before deciding the next)",
    "8",
    _workers,
    example="8",
    metavar="N",
)


def _share(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError("must be a whole number of pods (0: no bound)")
    return value


NAMESPACE_POD_SHARE: Flag[int] = Flag(
    "namespace-pod-share",
    "waiting pods of one namespace kept in memory; past it a namespace's new pods are shed "
    "(evented, counted in carve_shed_pods) and taken up in the order they came as earlier ones "
    "are placed, so one namespace cannot run the controller out of memory (0: no bound)",
    str(DEFAULT_SHARE),
    _share,
    example=str(DEFAULT_SHARE),
    metavar="N",
)


def _policy(text: str) -> Policy:
    try:
        return Policy(text.strip())
    except ValueError:
        raise ValueError(f"must be one of {', '.join(p.value for p in Policy)}") from None


PACKING_POLICY: Flag[Policy] = Flag(
    "packing-policy",
    "how the placement engine prefers one feasible placement over another: "
    + ", ".join(p.value for p in Policy)
    + " (docs/placement.md; docs/benchmarks.md measures them against kube-scheduler)",
    DEFAULT_POLICY.value,
    _policy,
    example=DEFAULT_POLICY.value,
    metavar="POLICY",
)
LEADER_ELECT = flags.switch("leader-elect", "run leader election", default=True)
LEASE_NAME: Flag[str] = Flag(
    "lease-name", "Lease object name", "carve-controller", flags.nonempty, example="carve"
)
LEASE_NAMESPACE: Flag[str] = Flag(
    "lease-namespace",
    "Lease namespace",
    "carve-system",
    flags.nonempty,
    example="carve-system",
    also_env=("POD_NAMESPACE",),
)
LEASE_DURATION = flags.duration("lease-duration", "lease duration", "15s")
RENEW_DEADLINE = flags.duration("renew-deadline", "renew deadline", "10s")
RETRY_PERIOD = flags.duration("retry-period", "leader-election retry period", "2s")
RESYNC_PERIOD = flags.resync_period(
    "10m",
    "how often every cached pod and claim is examined again (informers watch and relist only "
    "when a watch cannot resume)",
)
RETRY_INTERVAL = flags.duration(
    "retry-interval", "how often a waiting pod is retried without any change", "30s"
)
REQUEST_TIMEOUT = flags.duration(
    "request-timeout",
    "client timeout of every apiserver request (writes, reads, lists, a watch's reconnect); "
    "watches time out on their own and the lease after --renew-deadline. A shutdown waits "
    "this long for writes in flight before it hands the lease over",
    "10s",
)
HTTP_ADDRESS = flags.http_address()
IDENTITY: Flag[str] = Flag(
    "identity",
    "leader-election identity, also the events' reporting instance",
    socket.gethostname(),
    flags.nonempty,
    example="carve-controller-0",
    also_env=("POD_NAME",),
)


def command_line() -> flags.CommandLine:
    return flags.CommandLine(
        PROG,
        "Central MIG allocator for carve (a DRA driver for NVIDIA MIG).",
        (
            flags.KUBECONFIG,
            flags.DRIVER_NAME,
            DEVICE_CLASSES,
            NATIVE_FALLBACK_AFTER,
            NODE_LOSS_GRACE,
            PREEMPTION,
            PREEMPTION_HOLD,
            HOLD_GATE_UNTIL_CARVED,
            CARVE_WAIT,
            COMMIT_WORKERS,
            NAMESPACE_POD_SHARE,
            PACKING_POLICY,
            LEADER_ELECT,
            LEASE_NAME,
            LEASE_NAMESPACE,
            IDENTITY,
            LEASE_DURATION,
            RENEW_DEADLINE,
            RETRY_PERIOD,
            RESYNC_PERIOD,
            RETRY_INTERVAL,
            REQUEST_TIMEOUT,
            HTTP_ADDRESS,
            *flags.LOGGING,
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse view of the flags (for --help); `parse_options` is what reads them."""
    return command_line().parser()


@dataclass(frozen=True)
class ControllerOptions:
    """Everything the controller is configured with, parsed and checked."""

    kubeconfig: str | None
    driver_name: str
    device_classes: frozenset[str] | None
    native_fallback_after: float | None
    identity: str
    lease: LeaseConfig | None  # None: no leader election
    resync_period: float
    retry_interval: float
    http_address: str
    log_format: str
    log_level: str
    deprecations: tuple[str, ...] = ()
    node_loss_grace: float | None = 300.0  # None: the NotReady signal is off
    preemption: bool = True
    preemption_hold: float = 300.0
    hold_gate_until_carved: bool = True
    carve_wait: float = 30.0
    commit_workers: int = 8
    packing_policy: Policy = DEFAULT_POLICY
    request_timeout: float = 10.0
    namespace_pod_share: int = DEFAULT_SHARE  # 0: no bound


def parse_options(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ControllerOptions:
    """Flags, then the environment, then defaults; UsageError for anything unusable."""
    got = command_line().parse(argv, env)
    lease: LeaseConfig | None = None
    if got[LEADER_ELECT]:
        try:
            lease = LeaseConfig(
                name=got[LEASE_NAME],
                namespace=got[LEASE_NAMESPACE],
                identity=got[IDENTITY],
                lease_duration_s=got[LEASE_DURATION],
                renew_deadline_s=got[RENEW_DEADLINE],
                retry_period_s=got[RETRY_PERIOD],
                driver_name=got[flags.DRIVER_NAME],
            )
        except ValueError as e:
            raise UsageError(
                f"--retry-period, --renew-deadline, --lease-duration: {e} "
                "(e.g. --retry-period=2s --renew-deadline=10s --lease-duration=15s)"
            ) from None
    return ControllerOptions(
        kubeconfig=got[flags.KUBECONFIG],
        driver_name=got[flags.DRIVER_NAME],
        device_classes=got[DEVICE_CLASSES],
        native_fallback_after=got[NATIVE_FALLBACK_AFTER],
        identity=got[IDENTITY],
        lease=lease,
        resync_period=got[RESYNC_PERIOD],
        retry_interval=got[RETRY_INTERVAL],
        http_address=got[HTTP_ADDRESS],
        log_format=got[flags.LOG_FORMAT],
        log_level=got[flags.LOG_LEVEL],
        deprecations=got.deprecations,
        node_loss_grace=got[NODE_LOSS_GRACE] or None,
        preemption=got[PREEMPTION],
        preemption_hold=got[PREEMPTION_HOLD],
        hold_gate_until_carved=got[HOLD_GATE_UNTIL_CARVED],
        carve_wait=got[CARVE_WAIT],
        commit_workers=got[COMMIT_WORKERS],
        namespace_pod_share=got[NAMESPACE_POD_SHARE],
        packing_policy=got[PACKING_POLICY],
        request_timeout=got[REQUEST_TIMEOUT],
    )


# -- HTTP --------------------------------------------------------------------------------------


def serve_http(
    address: str,
    metrics: ControllerMetrics,
    unsynced: Callable[[], Sequence[str]],
    liveness: Callable[[], str] = lambda: "",
) -> OpsServer:
    """Start the ops endpoints; /readyz names the one thing that gates the controller, and
    which kinds are still being listed (a kind that never syncs is an RBAC or API gap);
    /healthz fails while the decision loop is stuck (`controller.liveness`)."""

    def informers() -> str:
        waiting = unsynced()
        return f"informers not synced yet: {', '.join(waiting)}" if waiting else ""

    server = OpsServer(
        address, metrics.registry, {"informers": informers}, liveness={"decisions": liveness}
    )
    server.start()
    return server


# -- wiring ------------------------------------------------------------------------------------


def _share_parts(
    share: NamespaceShare,
    kube: KubeJson,
    informers: list[Informer],
    recorder: DeferredRecorder,
    metrics: ControllerMetrics,
) -> tuple[Refetcher, ShedReport]:
    """The namespace share's reader (GETs through the JSON client, delivered to the informer
    that shed the object) and its report (events and gauges, from the decision thread)."""
    by_kind = {inf.kind: inf for inf in informers}
    refetcher = Refetcher(
        share,
        lambda kind, key: kube.request("GET", _object_path(kind, key)),
        lambda kind, obj: by_kind[kind].refresh(obj, lambda k: share.wants(kind, k)),
    )
    report = ShedReport(share, recorder.event, metrics.shed_pods.set, metrics.pods_shed.inc)
    return refetcher, report


def _object_path(kind: Kind, key: str) -> str:
    namespace, _, name = key.partition("/")
    if kind is Kind.POD:
        return f"/api/v1/namespaces/{namespace}/pods/{name}"
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


def default_planner(driver: str, policy: Policy = DEFAULT_POLICY) -> Planner:
    """The placement engine behind the reconciler's `Planner` seam."""
    from controller.planner import EnginePlanner

    return EnginePlanner(driver, policy)


def _preemptor(
    kube: KubeJson,
    planner: Planner,
    recorder: DeferredRecorder,
    opts: ControllerOptions,
    fence: Callable[[], bool],
) -> PreemptionHook | None:
    """MIG-aware preemption needs the engine's model to judge victim sets, so it runs only
    with the engine planner, and only when --preemption is on."""
    from controller.planner import EnginePlanner

    if not opts.preemption or not isinstance(planner, EnginePlanner):
        return None
    from controller.preemption.eviction import KubeEvictor
    from controller.preemption.preemptor import PreemptionConfig, Preemptor

    evictor = KubeEvictor(kube, fence=fence)
    return Preemptor(
        planner, evictor, recorder, config=PreemptionConfig(hold_s=opts.preemption_hold)
    )


class Controller:
    """The assembled process; `run` blocks until `stop` (or the lease is lost)."""

    def __init__(
        self,
        api_client: Any,
        opts: ControllerOptions,
        planner: Planner | None = None,
    ) -> None:

        self.opts = opts
        self.metrics = ControllerMetrics()
        # Every request counted where they all pass, whichever part sends it.
        api_client = count_requests(api_client, self.metrics.count_request)
        kube = KubeJson(api_client, request_timeout=opts.request_timeout)
        self.stop_event = threading.Event()
        self.exit_code = 0
        self.liveness = LoopLiveness()
        contract = Contract(opts.driver_name)
        self.config = ReconcilerConfig(
            contract=contract,
            classes=CarveClasses.of(contract, opts.device_classes),
            native_fallback_after=opts.native_fallback_after,
            retry_interval=opts.retry_interval,
            node_loss_grace=opts.node_loss_grace,
            hold_gate_until_carved=opts.hold_gate_until_carved,
            carve_wait=opts.carve_wait,
        )
        self.elector: LeaderElector | None = None
        if opts.lease is not None:
            # each call bounded by its deadline; no renewal while the loop is stuck
            self.elector = LeaderElector(kube, opts.lease, alive=self.liveness.check)
        fence = self.elector.is_leader if self.elector else (lambda: True)
        self.writer = KubeClaimWriter(kube, contract=contract, fence=fence)
        self.recorder = KubeRecorder(
            kube,
            controller=contract.event_source,
            instance=opts.identity,
        )
        # Events and pod conditions are best effort: written beside the decision thread, not
        # on it, so a placement waits only for the writes that make it (controller.writepool).
        self.best_effort_writes = WritePool()
        recorder = DeferredRecorder(self.recorder, self.best_effort_writes)
        planner = planner or default_planner(opts.driver_name, opts.packing_policy)
        self.planner = planner
        # Release writes (allocation cleared, finalizer dropped) beside the decision thread too,
        # on their own workers so that events queued behind never delay a release.
        self.release_writes = WritePool(workers=2)
        # Placement writes too: each placement is assumed in the model meanwhile, so pods are
        # decided one at a time but written many at once (Reconciler, commit_beside).
        self.commit_writes = WritePool(workers=opts.commit_workers) if opts.commit_workers else None
        self.reconciler = Reconciler(
            planner,
            self.writer,
            recorder,
            config=self.config,
            metrics=self.metrics,
            is_leader=fence,
            defer=self.best_effort_writes.submit,
            preemption=_preemptor(kube, planner, recorder, opts, fence),
            release_beside=self.release_writes.offer,
            commit_beside=self.commit_writes.offer if self.commit_writes else None,
        )
        self.resync_s = opts.resync_period
        self.share = NamespaceShare(opts.namespace_pod_share)
        self.informers: list[Informer] = standard_informers(
            kube,
            self.reconciler.enqueue,
            self.reconciler.mark_synced,
            InformerConfig(),
            contract=contract,
            classes=self.config.classes,
            share=self.share,
        )
        self.refetcher, self.shed_report = _share_parts(
            self.share, kube, self.informers, recorder, self.metrics
        )
        self._http: OpsServer | None = None
        self._usage_thread: threading.Thread | None = None

    def ready(self) -> bool:
        return not self.unsynced()

    def unsynced(self) -> list[str]:
        """The kinds whose first list has not completed."""
        return [str(i.kind) for i in self.informers if not i.has_synced]

    def _on_lost(self) -> None:
        self.exit_code = EXIT_LOST_LEASE
        self.metrics.leader.set(0)
        self.stop_event.set()

    def run(self) -> int:
        if self.opts.http_address:
            self._http = serve_http(
                self.opts.http_address, self.metrics, self.unsynced, self.liveness.check
            )
        start_informers(self.informers, time.monotonic)
        threading.Thread(target=self.refetcher.run, name="share-refetch", daemon=True).start()
        if self.elector is not None:
            elector = self.elector
            threading.Thread(
                target=elector.run,
                args=(lambda: self.metrics.leader.set(1), self._on_lost),
                name="leader-election",
                daemon=True,
            ).start()
        else:
            self.metrics.leader.set(1)
        next_resync = time.monotonic() + self.resync_s
        next_usage = 0.0
        frozen = False
        while not self.stop_event.is_set():
            self.liveness.beat()
            try:
                self.reconciler.step(timeout=0.5)
                self.shed_report.report()
                now = time.monotonic()
                if not frozen and self.reconciler.synced:
                    _freeze_heap()
                    frozen = True
                if now >= next_resync:
                    self.reconciler.resync()
                    _freeze_heap()
                    next_resync = now + self.resync_s
                if now >= next_usage and self.reconciler.synced:
                    self._update_usage_beside()
                    next_usage = now + 15.0
            except Exception:
                _log.exception("reconcile step failed; continuing")
                self.stop_event.wait(1.0)
        self.shutdown()
        return self.exit_code

    def _update_usage_beside(self) -> None:
        """The usage gauges read every slice and claim (over a second at 1,000 GPU nodes):
        snapshot the stores here, on the decision thread that owns them, and compute on a
        thread of its own, one at a time. Cached objects are replaced, never changed, so the
        snapshot stays consistent."""
        if self._usage_thread is not None and self._usage_thread.is_alive():
            return
        stores = {k: dict(v) for k, v in self.reconciler.stores.items() if k in _USAGE_KINDS}
        self._usage_thread = threading.Thread(
            target=self.metrics.update_usage,
            args=(stores, self.config.driver),
            name="usage-gauges",
            daemon=True,
        )
        self._usage_thread.start()

    def shutdown(self) -> None:
        """Stop, handing the lease over only once no write of this term can still land."""
        for inf in self.informers:
            inf.stop()
        self.refetcher.stop()
        pools = [self.commit_writes, self.release_writes, self.best_effort_writes]
        deadline = time.monotonic() + self.opts.request_timeout + _DRAIN_MARGIN_S
        drains = [p.drain for p in pools if p is not None]
        if self.elector is not None:
            hand_over(self.elector, drains, deadline, lost=self.exit_code == EXIT_LOST_LEASE)
        else:
            for drain in drains:
                drain(deadline)
        if self._http is not None:
            self._http.stop()

    def stop(self) -> None:
        self.stop_event.set()


_DRAIN_MARGIN_S = 2.0
"""A hand-over waits for the writes in flight as long as one request may take
(`--request-timeout`), and this much more for their answers to be handled."""


def hand_over(
    elector: LeaderElector,
    drains: Sequence[Callable[[float], bool]],
    deadline: float,
    *,
    lost: bool = False,
) -> bool:
    """client-go's ReleaseOnCancel rule: close the write fence (no write starts from now on,
    and a retry in progress stops at its next attempt), wait until every write already in
    flight has ended (`drains`, each a `WritePool.drain`, until `deadline`), and only then hand
    the lease back. The lease is renewed meanwhile, so no successor decides while an old write
    can still land; if some write outlives the deadline the lease is left to expire instead.
    Returns whether the lease was handed back."""
    elector.close_fence()
    drained = [drain(deadline) for drain in drains]  # every pool, not only up to a failure
    release = all(drained) and not lost
    if not all(drained):
        _log.warning(
            "writes still in flight at shutdown; leaving the lease to expire instead of "
            "handing it over"
        )
    elector.stop(release=release)
    return release


def _freeze_heap() -> None:
    """Take what the controller holds now (cached API objects, the model) out of the cyclic
    garbage collector's reach: at 1,000 GPU nodes a full collection walks millions of objects
    and stalls the decision thread. Cached objects are acyclic JSON, freed by reference
    counting when replaced, frozen or not; only a frozen reference cycle that later becomes
    garbage is kept until exit, which is why this runs after the initial lists and then once
    per resync period, not after every change."""
    gc.collect(1)
    gc.freeze()


_GIL_SWITCH_S = 0.0005
"""How long a thread that wants the GIL waits before the thread holding it must let go
(CPython's default is 5 ms). The decision thread hands each placement to the commit workers,
and they hand the answers back, through the GIL, while watch threads parse events: at the
default each handoff can wait 5 ms. With 0.5 ms a queue of 300 pods drained x1.17 (300
nodes) and x1.21 (1,000 nodes) faster in bench.scale (docs/scale.md); start-up, when every
thread wants to run, was about a tenth slower."""


_GC_GEN0_THRESHOLD = 10_000
"""Allocations between two young-generation collections (CPython's default is 700). A
collection runs in whichever thread crosses the threshold, and in carve-controller most
allocations are the watch and writer threads' (parsed events, HTTP answers), so at the
default about one decision in 18 paid for a collection it did not cause (bench.scale, 100
nodes: 45 of 800 decisions, 2-6 ms each, the p99 of the deciding thread's CPU time). With
the cached heap frozen (`_freeze_heap`) the young generation holds only new objects, so a
larger one costs little to walk."""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        return usage_exit(PROG, e)
    start_logging(opts.log_format, opts.log_level, opts.deprecations)
    sys.setswitchinterval(_GIL_SWITCH_S)
    gc.set_threshold(_GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    try:
        # Watches, event and release writers, commit workers, leader election: one each.
        connections = opts.commit_workers + 16
        api_client = load_api_client(
            opts.kubeconfig, connections=connections, request_timeout=opts.request_timeout
        )
        controller = Controller(api_client, opts)
    except KubeconfigError as e:
        _log.error(str(e))
        return 1
    stop_on_signals(controller.stop)
    _log.info("carve-controller starting as %s", opts.identity)
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
