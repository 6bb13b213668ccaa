"""`carve-kubelet-plugin`: the node agent's entry point (composition root).

Its flags and their environment twins are in `kubeletplugin.options`.

`main` serves the ops endpoints first, before anything slow: /healthz answers from the first
second, and /readyz's `startup` check says what start-up is doing. `NodePlugin` then assembles
everything in `__init__` (NVML or the simulator, the driver's files under --driver-root for the
CDI specs, the checkpoint, the preparer, the publisher, the sockets' server) without serving a
socket. On real hardware a driver root without a driver makes it refuse to start with a
message naming the flag. `run()` hands start-up to a thread of its own, in an order that
matters (docs/kubeletplugin.md, "Start-up and shutdown"):

1. reconcile the checkpoint with NVML (finish or roll back interrupted work, record foreign
   instances, forget claims whose instances vanished), its API calls sharing
   RECONCILE_API_SECONDS, before the kubelet can send a single request;
2. serve the DRA socket, then the registration socket (PluginServer does them in that order);
3. once the apiserver answers, release claims gone from the API (one read per checkpointed
   claim), so that their placements are free before the devices are published;
4. publish ResourceSlices and keep them published; then housekeeping (step 3) every 30 s.

The main thread meanwhile watches registration, the GPUs and the stop signal. `stop()`
(SIGTERM/SIGINT) ends `run()`, which lets start-up finish the step it is in, then stops intake
first (sockets), then the publisher (deleting the slices only with --cleanup-on-exit), then the
worker pool, so no prepare is cut off half-way by our own shutdown.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kubeletplugin.options import (
    DRIVER_ROOT,
    PROG,
    ROOT,
    Options,
    parse_options,
)
from process.entrypoint import start_logging, stop_on_signals, usage_exit
from process.flags import UsageError
from process.kubeconfig import KubeconfigError, load_api_client

if TYPE_CHECKING:
    from driver.driverroot import DriverFiles
    from driver.naming import DevicePlace
    from kubeletplugin.checkpoint import ForeignInstance
    from kubeletplugin.foreign import ForeignTaints
    from kubeletplugin.gpuhealth import HealthMonitor
    from kubeletplugin.gpuwatch import GpuWatch
    from kubeletplugin.metrics import PluginMetrics
    from kubeletplugin.mps import MpsControl
    from kubeletplugin.nodehardware import NodeHardware
    from kubeletplugin.precarve import PreCarve
    from kubeletplugin.prepare import Preparer
    from kubeletplugin.publisher import PublisherSettings, SlicePublisher
    from kubeletplugin.server import PluginServer
    from kubeletplugin.startup import StartupProgress
    from process.kube.jsonclient import KubeJson
    from process.opshttp import OpsServer

log = logging.getLogger("carve.kubeletplugin")

_RETRY_PENDING_SECONDS = 30.0
# urllib3's retries of one API request (each with the whole timeout): one covers a pooled
# connection the apiserver closed; three, the default, cost 40 s against a silent apiserver.
_API_RETRIES = 1
# How often the GPUs are enumerated again, to tell a GPU that fell off the bus or came back.
_GPU_CHECK_SECONDS = 5.0

# -- the assembled node agent ------------------------------------------------------------------


def _publisher_settings(opts: Options) -> PublisherSettings:
    from kubeletplugin.publisher import PublisherSettings

    return PublisherSettings(opts.driver_name, opts.node_name, resync_seconds=opts.resync_period)


def cleanup_slices(opts: Options, api: KubeJson) -> int:
    """`--cleanup`: delete this node's ResourceSlices and exit, without opening NVML."""
    from kubeletplugin.metrics import PluginMetrics
    from kubeletplugin.publisher import SlicePublisher

    publisher = SlicePublisher(_publisher_settings(opts), api, lambda g, s: [], PluginMetrics())
    removed = publisher.cleanup()
    print(f"removed {removed} ResourceSlice(s) of {opts.driver_name} on {opts.node_name}")
    return 0


class NodePlugin:
    """The assembled node agent; `run` blocks until `stop`."""

    def __init__(
        self,
        opts: Options,
        api: KubeJson,
        *,
        stop: threading.Event | None = None,
        ops: OpsServer | None = None,
        metrics: PluginMetrics | None = None,
        startup: StartupProgress | None = None,
    ) -> None:
        """`ops` (with `metrics`, whose registry it serves, and `startup`, its check until
        now): the ops server `main` started before assembling, handed this plugin's checks at
        the end; without it one is made here (not started) when --http-address is set."""
        from driver.cdi import CdiWriter
        from kubeletplugin.agentlock import hold_checkpoint_dir
        from kubeletplugin.checkpoint import CheckpointStore
        from kubeletplugin.claims import KubernetesClaimClient, KubernetesClaimEvents
        from kubeletplugin.controllerskew import ControllerContract
        from kubeletplugin.foreign import ForeignPolicy
        from kubeletplugin.metrics import PluginMetrics
        from kubeletplugin.nodeevents import KubernetesNodeEvents
        from kubeletplugin.nodehardware import open_backend
        from kubeletplugin.prepare import Preparer, PreparerSettings
        from kubeletplugin.startup import StartupProgress, early_ops

        self.opts = opts
        self.api = api
        self._stop = stop if stop is not None else threading.Event()
        self.metrics: PluginMetrics = metrics if metrics is not None else PluginMetrics()
        self.startup: StartupProgress = startup if startup is not None else StartupProgress()
        self._startup_thread: threading.Thread | None = None
        self._startup_error: Exception | None = None
        self._started: set[str] = set()  # the parts start-up has started, for shutdown
        self.startup.phase("opening NVML and the checkpoint")
        self.node: NodeHardware = open_backend(
            opts.simulate, opts.driver_root, timeout=opts.nvml_timeout
        )
        self.driver_files: DriverFiles | None = self._driver_files()
        self.node_events = KubernetesNodeEvents(api, driver=opts.driver_name, node=opts.node_name)
        # One agent per node: before anything reads the checkpoint directory (the checkpoint,
        # the GPU health state), held until the process exits (kubeletplugin.agentlock).
        self.startup.phase("locking the checkpoint directory (one agent per node)")
        self.lock = hold_checkpoint_dir(
            opts.checkpoint_dir, stop=self._stop, events=self.node_events
        )
        self.preparer: Preparer = Preparer(
            settings=PreparerSettings(
                driver_name=opts.driver_name,
                node_name=opts.node_name,
                pool_name=opts.node_name,
                foreign_policy=ForeignPolicy(opts.foreign_instances),
                warm=opts.warm,
            ),
            backend=self.node.mig,
            claims=KubernetesClaimClient(api),
            store=CheckpointStore(opts.checkpoint_dir),
            cdi=CdiWriter(opts.cdi_root, vendor=opts.driver_name),
            metrics=self.metrics,
            common_nodes=self.node.common_device_nodes(),
            shared_edits=self.driver_files.spec_edits() if self.driver_files else None,
            dev_root=opts.dev_root,
            mps=self._mps_control(),
            events=KubernetesClaimEvents(api, driver=opts.driver_name, node=opts.node_name),
            node_events=self.node_events,
            offers_changed=self._republish,
        )
        self.health: HealthMonitor = self._health_monitor()
        self.gpu_watch: GpuWatch = self._gpu_watch()
        self._back_pending = threading.Event()  # a GPU answers again: finish what it stopped
        self.precarve: PreCarve | None = self._precarve() if opts.binding_conditions else None
        self.publisher: SlicePublisher = self._publisher()
        self.controller_contract = ControllerContract.wired(self)  # the skew rule, plugin side
        self.server: PluginServer = self._server()
        self.ops: OpsServer | None = ops
        if self.ops is None and opts.http_address:
            self.ops = early_ops(opts.http_address, self.metrics, self.startup)
        if self.ops is not None:
            self.ops.set_checks(self._checks(), {"gpus": self._gpus_check})

    def _mps_control(self) -> MpsControl:
        """MPS daemons: in pods of their own with --mps-daemon-image, else children."""
        from kubeletplugin.mps import MpsControl, find_binary
        from kubeletplugin.mpspods import DaemonPods, PodSettings

        opts, pods = self.opts, None
        if opts.mps_daemon_image and opts.mps_daemon_namespace:
            pods = DaemonPods(
                self.api,
                PodSettings(
                    namespace=opts.mps_daemon_namespace,
                    image=opts.mps_daemon_image,
                    node_name=opts.node_name,
                    driver_name=opts.driver_name,
                    pull_policy=opts.mps_daemon_pull_policy,
                    service_account=opts.mps_daemon_service_account or "",
                    driver_root=opts.driver_root,
                    dev_root=opts.dev_root,
                ),
            )
        return MpsControl(
            find_binary(self.driver_files.root) if self.driver_files else None,
            opts.plugins_dir / opts.driver_name / "mps",
            pods=pods,
        )

    def _health_monitor(self) -> HealthMonitor:
        from driver.contract import Contract
        from kubeletplugin.gpuhealth import HealthMonitor
        from kubeletplugin.healthstate import FILE_NAME as HEALTH_FILE
        from kubeletplugin.healthstate import HealthStateFile

        return HealthMonitor(
            self.node.mig,
            [g.uuid for g in self.node.mig.gpus() if g.mig_capable],
            policy=self.opts.health,
            taint_key=Contract(self.opts.driver_name).health_taint_key,
            poll_seconds=self.opts.health_poll_period,
            on_change=self._republish,
            state=HealthStateFile(self.opts.checkpoint_dir / HEALTH_FILE),
            events=self.node_events,
        )

    def _gpu_watch(self) -> GpuWatch:
        from driver.contract import Contract
        from kubeletplugin.gpuwatch import GpuWatch

        return GpuWatch(
            self.node.mig,
            self.node_events,
            self.metrics,
            taint_key=Contract(self.opts.driver_name).unresponsive_taint_key,
            on_back=self._gpus_back,
            on_change=self._republish,
        )

    def _gpus_back(self) -> None:
        """GPUs answer again: those lost or failing when the plugin started are new to its
        parts (prepare on them, watch their health, publish them), and housekeeping finishes
        what a hang or loss interrupted there (teardowns left in UnprepareStarted)."""
        self.preparer.gpus_changed()
        self.health.watch([g.uuid for g in self.node.mig.gpus() if g.mig_capable])
        self._back_pending.set()

    def _precarve(self) -> PreCarve:
        from kubeletplugin.precarve import build_precarve

        return build_precarve(
            self.api,
            self.preparer,
            driver=self.opts.driver_name,
            node=self.opts.node_name,
            gpu_uuids={g.minor: g.uuid for g in self.node.mig.gpus()},
            cooldown=self.opts.carve_failure_cooldown,
            publish_now=self._publish_now,
        )

    def _publish_now(self) -> None:
        """Publish before returning (precarve's taint must be out before its verdict)."""
        if self.opts.no_publish:
            return
        try:
            self.publisher.sync()
        except Exception as e:
            log.warning("publishing at once failed; the loop retries", extra={"error": str(e)})
            self.publisher.trigger()

    def _taints(self) -> Mapping[str, tuple[Mapping[str, str], ...]]:
        taints = dict(self.health.taints())
        for gpu, more in self.gpu_watch.taints().items():
            taints[gpu] = (*taints.get(gpu, ()), *more)
        if self.precarve is not None:
            for gpu, more in self.precarve.carver.failures.taints().items():
                taints[gpu] = (*taints.get(gpu, ()), *more)
        return taints

    def _foreign_taints(self) -> Mapping[str, ForeignTaints]:
        """GPU UUID -> what its devices carry because of MIG instances carve did not create."""
        from driver.contract import Contract
        from kubeletplugin.foreign import ForeignPolicy, foreign_taints

        by_gpu: dict[str, list[ForeignInstance]] = {}
        for f in self.preparer.checkpoint().foreign:
            by_gpu.setdefault(f.gpu_uuid, []).append(f)
        return {
            uuid: foreign_taints(
                self.node.mig.gpu_model(uuid),
                found,
                policy=ForeignPolicy(self.opts.foreign_instances),
                key=Contract(self.opts.driver_name).foreign_instance_taint_key,
                stuck=self.preparer.foreign.stuck_places(uuid),
            )
            for uuid, found in by_gpu.items()
        }

    def _device_taints(
        self, foreign: Mapping[str, ForeignTaints]
    ) -> Mapping[str, Mapping[DevicePlace, tuple[Mapping[str, str], ...]]]:
        out = {gpu: dict(places) for gpu, places in self.health.device_taints().items()}
        stuck = self.gpu_watch.stuck_device_taints(self.preparer.checkpoint())
        for gpu, places in stuck.items():
            mine = out.setdefault(gpu, {})
            for place, taints in places.items():
                mine[place] = (*mine.get(place, ()), *taints)
        for gpu, ft in foreign.items():
            mine = out.setdefault(gpu, {})
            for place, taints in ft.devices.items():
                mine[place] = (*mine.get(place, ()), *taints)
        return out

    def _slices(self, generation: int, split: bool) -> list[dict[str, Any]]:
        from driver.contract import Contract

        opts = self.opts
        contract = Contract(opts.driver_name)
        foreign = self._foreign_taints()
        return self.node.resource_slices(
            driver=opts.driver_name,
            node_name=opts.node_name,
            generation=generation,
            split=split,
            whole=self.preparer.whole_gpus(),
            taints=self._taints(),
            device_taints=self._device_taints(foreign),
            whole_taints={gpu: ft.whole for gpu, ft in foreign.items()},
            binding_conditions=(
                (contract.carved_condition, contract.carve_failed_condition)
                if opts.binding_conditions
                else None
            ),
        )

    def _republish(self) -> None:
        """A GPU was taken or given back whole, which changes what the node offers: republish
        now rather than at the next resync. (The preparer exists before the publisher.)"""
        self.publisher.trigger()

    def _driver_files(self) -> DriverFiles | None:
        """The driver's files for every claim's CDI spec, found once at start-up.

        On real hardware a node without them cannot run a single CUDA container, so the plugin
        refuses to start (DriverRootError names the flag). With --simulate the simulator first
        fills the given driver root and dev root; without --driver-root the specs carry device
        nodes only, as before.
        """
        from driver.driverroot import DriverRootError, discover

        opts = self.opts
        if opts.simulate is not None:
            from driver.nvml import sim

            sim.sim_node_files(
                None if opts.driver_root == ROOT else opts.driver_root,
                None if opts.dev_root == ROOT else opts.dev_root,
            )
            if opts.driver_root == ROOT:
                return None
        gpus = self.node.mig.gpus()
        try:
            files = discover(opts.driver_root, version=gpus[0].driver_version if gpus else None)
        except DriverRootError as e:
            raise DriverRootError(
                f"{e}; start {PROG} with --driver-root (or {DRIVER_ROOT.env}) set to the root the "
                "driver is installed under: / for a driver on the host, /run/nvidia/driver with "
                "the GPU Operator's driver container"
            ) from e
        log.info(
            "driver files found",
            extra={
                "driverRoot": str(files.root),
                "driverVersion": files.version,
                "mounts": len(files.mounts),
                "hook": files.hook_binary,
            },
        )
        if files.hook_binary is None:
            log.warning(
                "no nvidia-cdi-hook or nvidia-ctk found: the CDI specs carry no hooks, so "
                "containers get the versioned driver libraries without their libcuda.so.1-style "
                "links and ld.so cache entries; install the NVIDIA container toolkit on the node",
                extra={"driverRoot": str(files.root)},
            )
        return files

    def _publisher(self) -> SlicePublisher:
        from kubeletplugin.publisher import SlicePublisher

        publisher = SlicePublisher(
            _publisher_settings(self.opts), self.api, self._slices, self.metrics
        )
        publisher.on_conflict = lambda message: self.node_events.event(
            type_="Warning",
            reason="ResourceSliceConflict",
            message=message,
            action="PublishResourceSlices",
        )
        return publisher

    def _server(self) -> PluginServer:
        from kubeletplugin.server import PluginServer

        opts = self.opts
        return PluginServer(
            opts.driver_name,
            opts.registry_dir,
            opts.plugins_dir,
            self.preparer,
            self.node.health_source(
                opts.driver_name,
                opts.node_name,
                self.preparer.refused_gpus,
                self.preparer.mps_down_devices,
                whole=self.preparer.whole_gpus,
                sick=self.health.unhealthy,
                sick_devices=self.health.unhealthy_devices,
            ),
        )

    def _checks(self) -> dict[str, Callable[[], str]]:
        """/readyz's checks: each failing one makes the agent not ready. The `gpus` report
        is not among them: a lost GPU is shown there, but the agent serves the node's other
        GPUs, so a rollout gated on readiness must not stop at it (docs/kubeletplugin.md)."""
        return {
            "startup": self.startup.check,
            "registration": self._registration_check,
            "apiserver": self._api_check,
            "resourceslices": self._slices_check,
            "checkpoint": self._pending_check,
            **({"claimwatch": self._claim_watch_check} if self.precarve is not None else {}),
        }

    # -- readiness (/readyz names each) -------------------------------------------------------

    def _api_check(self) -> str:
        from kubeletplugin.startup import READYZ_API_TIMEOUT

        try:
            self.api.request("GET", "/version", timeout=READYZ_API_TIMEOUT)
            return ""
        except Exception as e:
            return f"apiserver unreachable: {e}"

    def _registration_check(self) -> str:
        st = self.server.registration
        if st.registered:
            return ""
        return st.error or "kubelet has not registered the plugin yet"

    def _slices_check(self) -> str:
        if self.publisher.conflict:
            return self.publisher.conflict
        if self.opts.no_publish or self.publisher.synced_once.is_set():
            return ""
        return self.publisher.last_error or "ResourceSlices not published yet"

    def _claim_watch_check(self) -> str:
        """With --binding-conditions a plugin that cannot watch claims never reports a carve,
        and every pod allocated here waits for it: say so where the operator looks."""
        assert self.precarve is not None
        watch = self.precarve.watch
        if watch.synced.is_set() and not watch.last_error:
            return ""
        return watch.last_error or "ResourceClaims not listed yet"

    def _gpus_check(self) -> str:
        """Which GPUs are out (lost, unresponsive or failing): each is isolated, the others
        keep working, and the operator sees which one (`/readyz`'s `gpus` report, the gauges,
        a Node event, its devices' taints)."""
        return self.gpu_watch.summary()

    def _pending_check(self) -> str:
        from kubeletplugin.checkpoint import ClaimState

        n = sum(
            1
            for r in self.preparer.checkpoint().claims.values()
            if r.state is not ClaimState.PREPARE_COMPLETED
        )
        return f"{n} interrupted claim operation(s) pending" if n else ""

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        """Start up behind the ops endpoints (reconcile, serve, release, publish: see the
        module docstring), watch until `stop()`, then shut down in order."""
        if self.ops is not None:
            self.ops.start()
        self._startup_thread = threading.Thread(target=self._start_up, name="startup", daemon=True)
        self._startup_thread.start()
        self._serve_until_stopped()
        self._shutdown()
        return 1 if self._startup_error is not None else 0

    def _start_up(self) -> None:
        """Start-up's steps, then housekeeping every 30 s until `stop()`. A start-up step
        that raises stops the agent (exit 1, as when it ran before serving): a plugin that
        cannot reconcile or open its sockets must not look alive."""
        try:
            if not self._reconcile_and_serve():
                return
            self.controller_contract.poll()  # once serving: a slow apiserver must not delay it
            if not self._release_vanished_claims():
                return
            self._publish()
        except Exception as e:
            log.exception("start-up failed; stopping")
            self._startup_error = e
            self.startup.phase(f"failed: {e}")
            self._stop.set()
            return
        while not self._stop.is_set():
            # every 30 s, or at once when a GPU answers again (`_gpus_back`)
            self._back_pending.wait(_RETRY_PENDING_SECONDS)
            if self._stop.is_set():
                return
            self._back_pending.clear()
            self.controller_contract.poll()
            try:
                self.preparer.retry_pending()
            except Exception:
                log.exception("housekeeping failed; trying again at the next pass")

    def _reconcile_and_serve(self) -> bool:
        """Steps 1 and 2: what the kubelet's registration waits for. False when stopped."""
        from kubeletplugin.startup import RECONCILE_API_SECONDS
        from process.kube.jsonclient import calls_within

        self.gpu_watch.check()  # GPUs that cannot be used are left out from here on, and told
        self.startup.phase(
            "reconciling the checkpoint with NVML (interrupted claims, foreign instances, "
            "CDI specs)"
        )
        # The API calls on the way (finalizers of torn-down claims, events) share one budget:
        # those that do not fit are left to housekeeping, and the kubelet's registration
        # waits for NVML, not for a slow apiserver.
        with calls_within(RECONCILE_API_SECONDS, "the start-up reconcile"):
            self.preparer.reconcile()
        if self._stop.is_set():
            return False
        self.startup.phase("serving the kubelet's sockets")
        self.health.start()  # before publishing: a GPU already sick is published tainted
        self._started.add("health")
        self.server.start()
        self._started.add("server")
        log.info(
            "carve kubelet plugin running",
            extra={
                "node": self.opts.node_name,
                "driver": self.opts.driver_name,
                "simulated": self.opts.simulate is not None,
                "driverRoot": str(self.driver_files.root) if self.driver_files else None,
                "opsPort": self.ops.port if self.ops is not None else None,
            },
        )
        return True

    def _release_vanished_claims(self) -> bool:
        """Step 3: release the instances of checkpointed claims gone from the API (the node
        came back to a different or rebuilt cluster, or finalizers were stripped by hand), so
        their placements are free before the node's devices are published again, not only at
        the first periodic pass. Not a condition of registration: a claim read that fails
        leaves everything as it is, and a prepare on a placement still taken fails and is
        retried by the kubelet. False when stopped first."""
        from kubeletplugin.startup import wait_for_apiserver

        what = f"{len(self.preparer.checkpoint().claims)} checkpointed claim(s)"
        self.startup.phase(f"waiting for the apiserver, to check {what} against it")
        while not self._stop.is_set():
            answered = wait_for_apiserver(
                self.api,
                self._stop,
                lambda error: self.startup.phase(
                    f"waiting for the apiserver, to check {what} against it: {error}"
                ),
                within=_RETRY_PENDING_SECONDS,
            )
            if answered and not self._stop.is_set():
                self.startup.phase(f"checking {what} against the API")
                self.preparer.retry_pending()
                return True
            if not self._stop.is_set():
                # what housekeeping did every 30 s before: its NVML half works without the API
                self.preparer.retry_pending()
        return False

    def _publish(self) -> None:
        """Step 4: publish ResourceSlices (and keep them published), and with
        --binding-conditions watch the claims to carve before binding."""
        self.startup.phase("starting to publish ResourceSlices")
        if not self.opts.no_publish:
            self.publisher.start()
            self._started.add("publisher")
        if self.precarve is not None:
            self.precarve.start()
            self._started.add("precarve")
        self.startup.finish()

    def _serve_until_stopped(self) -> None:
        last_verdict = self.server.registration
        next_gpu_check = time.monotonic()
        while not self._stop.wait(0.5):
            # Every registration (each verdict is a new object) may follow a kubelet restart, and
            # the kubelet wipes the node's slices when it starts: republish at once.
            verdict = self.server.registration
            if verdict is not last_verdict and verdict.registered:
                self.publisher.trigger()
            last_verdict = verdict
            if "server" not in self._started:
                continue  # the GPUs are watched once the agent serves them
            if self.precarve is not None:
                self.precarve.carver.expire_taints()
            if self.gpu_watch.due.is_set() or time.monotonic() >= next_gpu_check:
                self.gpu_watch.check()
                next_gpu_check = time.monotonic() + _GPU_CHECK_SECONDS

    def _shutdown(self) -> None:
        log.info("shutting down")
        if self._startup_thread is not None:
            self._back_pending.set()  # wakes housekeeping's wait, to see the stop
            # Start-up finishes the step it is in (a reconcile is never cut off; a wait for
            # the apiserver ends at once), so nothing below closes what it still uses.
            self._startup_thread.join()
        self.server.stop(grace=10.0)
        if "precarve" in self._started and self.precarve is not None:
            self.precarve.stop()
        if "health" in self._started:
            self.health.stop()
        if "publisher" in self._started:
            self.publisher.stop()
            if self.opts.cleanup_on_exit:
                try:
                    self.publisher.cleanup()
                except Exception:
                    log.exception("could not remove ResourceSlices on exit")
        self.preparer.close()
        self.node.close()
        if self.ops is not None:
            self.ops.stop()
        self.lock.release()
        log.info("stopped")

    def stop(self) -> None:
        """Make `run()` shut down; safe from a signal handler (it only sets an event)."""
        self._stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        return usage_exit(PROG, e)
    start_logging(opts.log_format, opts.log_level, opts.deprecations)
    # Installed before anything is opened: a SIGTERM during start-up still lets the recovery
    # finish and then shuts down in order, instead of killing the process half-way.
    stop = threading.Event()
    stop_on_signals(stop.set)
    from driver.driverroot import DriverRootError
    from driver.nvml.sim.config import SimConfigError
    from kubeletplugin.agentlock import LockWaitStoppedError
    from kubeletplugin.checkpoint import CheckpointVersionError
    from kubeletplugin.metrics import PluginMetrics
    from kubeletplugin.startup import StartupProgress, early_ops
    from process.kube.jsonclient import KubeJson

    ops = None
    try:
        api = KubeJson(load_api_client(opts.kubeconfig, retries=_API_RETRIES))
        if opts.cleanup:
            return cleanup_slices(opts, api)
        # /healthz from the first second: the kubelet's liveness probe must not kill an agent
        # that is still opening NVML or reconciling (issue 45; NVIDIA's DRA driver 773/774).
        metrics, startup = PluginMetrics(), StartupProgress()
        if opts.http_address:
            ops = early_ops(opts.http_address, metrics, startup)
            ops.start()
        plugin = NodePlugin(opts, api, stop=stop, ops=ops, metrics=metrics, startup=startup)
        return plugin.run()
    except KubeconfigError as e:
        log.error(str(e))
        return 1
    except LockWaitStoppedError as e:
        # Stopped while another agent held the node: nothing was served or changed.
        log.info("stopped before starting", extra={"reason": str(e)})
        return 0
    except CheckpointVersionError as e:
        # Not "fatal error" with a traceback: the operator needs the one message that says
        # which file, which version, and what to do (see kubeletplugin.checkpoint).
        log.error(str(e), extra={"checkpoint": str(e.path), "versionFound": e.found})
        return 1
    except (DriverRootError, SimConfigError) as e:
        # The node's driver (or simulated node) is unusable: one actionable line, no traceback.
        log.error(str(e), extra={"driverRoot": str(opts.driver_root)})
        return 1
    except Exception:
        log.exception("fatal error")
        return 1
    finally:
        if ops is not None:
            ops.stop()  # a no-op after run(); after a failed start-up it frees the port


if __name__ == "__main__":
    sys.exit(main())
