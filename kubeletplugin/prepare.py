"""Prepare and unprepare: the node agent's crash-safe state machine (the ClaimPreparer).

Per claim, every step is announced in the checkpoint before it touches the GPU:

    prepare:    read claim -> plan devices -> PREPARE_STARTED(intents) -> node finalizer
                -> per device: [GPU lock] enable MIG if needed, carve GI at the allocated placement
                   + full CI, record ids -> CDI spec -> PREPARE_COMPLETED
    unprepare:  UNPREPARE_STARTED -> per device: [GPU lock] destroy CI then GI -> remove CDI spec
                -> remove node finalizer -> drop record

A whole-GPU device gets the GPU with MIG mode off, because CUDA cannot use a GPU in MIG mode as
one device. On Hopper and later prepare records `restore_mig` on the device and then turns MIG
mode off (only when no instance exists: NVML refuses otherwise); unprepare turns it back on
before it clears the flag. On Ampere the change needs a GPU reset, so carve never makes it:
whole-GPU devices are published only for Ampere GPUs whose MIG mode is off, and an allocation of
one in MIG mode is refused with a message. While a claim holds a GPU whole, the node publishes
no MIG device on it (`whole_gpus`, `offers_changed`) and refuses to carve there.

With MPS sharing (kubeletplugin.mps), prepare records the MPS daemon's directories, starts it on
the carved slices and records its pid once it answers, all before the CDI spec; unprepare stops
it (quit, then kill) before it destroys a slice. Start-up keeps a prepared claim's daemon if it
answers and restarts it otherwise; housekeeping does the same for a daemon that died. A daemon
found dead marks the claim's devices unhealthy (`mps_down_devices`, merged into the kubelet's
health stream) until a later check finds it answering, and posts an Event on the claim.

A failure inside prepare tears down what this attempt built (the same path unprepare takes), so
the kubelet's retry starts clean. After a crash, `reconcile()` does the same for every claim left
in PREPARE_STARTED or UNPREPARE_STARTED, so nothing leaks and nothing is carved twice. MIG
instances that no record owns are *foreign*: they are recorded and handled by policy (adopt,
leave, refuse the GPU) and never destroyed silently.

Locks: one per claim UID (the kubelet may retry a claim while an earlier call still runs), one
per GPU (NVML changes to one GPU are serialised; different GPUs proceed in parallel), and one for
the in-memory checkpoint (held only while a new snapshot is saved, never across NVML calls).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as CountBy
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from driver.allocation import AllocatedDevice
from driver.catalog import GpuModel, Placement, ProfileSpec
from driver.cdi import (
    CdiDevice,
    CdiWriter,
    DeviceNode,
    SpecEdits,
    mig_device_nodes,
    whole_gpu_device_nodes,
)
from driver.config import ConfigError, MpsConfig, SharingStrategy, resolve_config
from driver.contract import Contract
from driver.naming import DevicePlace, parse_device_name
from driver.nvml.errors import InstanceMismatch, NotFound, NvmlError, PlacementTaken
from driver.nvml.types import CarvedInstance, GpuInfo, GpuInstance
from kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    ForeignInstance,
    MpsDaemon,
    WarmInstance,
    WarmState,
)
from kubeletplugin.claims import (
    ClaimClient,
    ClaimEvents,
    ClaimGoneError,
    ClaimView,
    describe_results,
)
from kubeletplugin.draservice import ClaimRef, PreparedDevice, PrepareResult
from kubeletplugin.foreign import WHOLE_GPU, ForeignPolicy, blocked_places, describe
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.mps import MpsControl, MpsError, commands_for
from kubeletplugin.nodeevents import NodeEvents
from kubeletplugin.warm import (
    Demand,
    WarmEvent,
    WarmSettings,
    expired,
    in_the_way,
    keep_verdict,
    park,
    placement_of,
    reusable_by,
    transition,
)

log = logging.getLogger(__name__)


# --- the NVML layer as the state machine needs it -------------------------------------------


class MigBackend(Protocol):
    """The slice of the NVML backend the state machine uses (see driver.nvml.backend)."""

    def gpus(self) -> Sequence[GpuInfo]: ...
    def gpu_model(self, gpu_uuid: str) -> GpuModel: ...
    def mig_enabled(self, gpu_uuid: str) -> bool: ...
    def enable_mig(self, gpu_uuid: str) -> object: ...
    def disable_mig(self, gpu_uuid: str) -> object: ...
    def instances(self, gpu_uuid: str) -> Sequence[GpuInstance]: ...
    def carve(self, gpu_uuid: str, profile_id: int, placement_start: int) -> CarvedInstance: ...
    def ensure_compute_instance(self, gpu_uuid: str, gi_id: int) -> CarvedInstance: ...
    def destroy(
        self,
        gpu_uuid: str,
        gi_id: int,
        *,
        expect_profile_id: int | None = None,
        expect_placement: Placement | None = None,
    ) -> None: ...
    def running_processes(self, gpu_uuid: str, mig_uuid: str) -> tuple[int, ...]: ...
    def caps_major(self) -> int: ...
    def cap_minors(self, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]: ...


# --- errors with a reason label (for metrics) and a message for the claim's user ------------


class ClaimError(Exception):
    """A claim that cannot be (un)prepared; `reason` labels the error metric, the message goes
    to the kubelet and from there to the pod's events."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class _Planned:
    result: AllocatedDevice
    gpu: GpuInfo
    profile: ProfileSpec | None
    placement: Placement | None
    env: Mapping[str, str]
    mps: MpsConfig | None = None  # MPS sharing asked for this device

    def record(self) -> DeviceRecord:
        return DeviceRecord(
            device_name=self.result.device,
            request_names=(self.result.request,),
            pool_name=self.result.pool,
            gpu_uuid=self.gpu.uuid,
            gpu_minor=self.gpu.minor,
            profile_id=None if self.profile is None else self.profile.id,
            placement_start=None if self.placement is None else self.placement.start,
            placement_size=None if self.placement is None else self.placement.size,
        )


@dataclass(frozen=True)
class PreparerSettings:
    driver_name: str
    node_name: str
    pool_name: str
    foreign_policy: ForeignPolicy = ForeignPolicy.LEAVE
    parallelism: int = 8
    warm: WarmSettings = field(default_factory=WarmSettings)


class Preparer:
    """ClaimPreparer over NVML, the checkpoint, CDI and the claim API."""

    def __init__(
        self,
        *,
        settings: PreparerSettings,
        backend: MigBackend,
        claims: ClaimClient,
        store: CheckpointStore,
        cdi: CdiWriter,
        metrics: PluginMetrics | None = None,
        common_nodes: Sequence[DeviceNode] = (),
        shared_edits: SpecEdits | None = None,
        dev_root: Path = Path("/"),
        clock: Callable[[], float] = time.monotonic,
        mps: MpsControl | None = None,
        events: ClaimEvents | None = None,
        node_events: NodeEvents | None = None,
        offers_changed: Callable[[], None] | None = None,
    ) -> None:
        """`common_nodes` go to every device (e.g. /dev/nvidia-uvm, whose major is dynamic).
        `shared_edits` go once into every claim's spec: the driver's files and hooks
        (`driver.driverroot.DriverFiles.spec_edits`). `dev_root` is where the device nodes
        are on the host; every node gets it as its hostPath unless it is /. `offers_changed` is
        called when what the node can offer changes (a GPU taken or given back whole), so that
        the ResourceSlices are republished at once."""
        self._s = settings
        self._offers_changed = offers_changed or (lambda: None)
        self._common_nodes = tuple(common_nodes)
        self._shared = shared_edits or SpecEdits()
        self._dev_root = dev_root
        self._mps = mps
        self._events = events
        self._node_events = node_events
        # claim uid -> (its MPS devices' names, why): daemons found dead, not yet seen answering
        self._mps_down: dict[str, tuple[tuple[str, ...], str]] = {}
        self._backend = backend
        self._claims = claims
        self._store = store
        self._cdi = cdi
        self.metrics = metrics or PluginMetrics()
        self._clock = clock
        self._finalizer = Contract(settings.driver_name).node_finalizer(settings.node_name)
        self._gpus: dict[int, GpuInfo] = {g.minor: g for g in backend.gpus()}
        self._cp = store.load()
        self._cp_lock = threading.Lock()
        self._locks_lock = threading.Lock()
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._claim_locks: dict[str, threading.Lock] = {}
        self._refused: dict[str, str] = {}  # gpu uuid -> why
        # Claims left half-done by an earlier process: only their teardown may look for an
        # instance by its intent (one carved just before a crash, before its id was saved).
        self._inherited = {
            uid for uid, r in self._cp.claims.items() if r.state is not ClaimState.PREPARE_COMPLETED
        }
        # gpu uuid -> places (WHOLE_GPU for the whole device) whose prepare a foreign instance
        # refused: published NoExecute so the stuck pod is evicted (kubeletplugin.foreign)
        self._stuck: dict[str, set[DevicePlace | None]] = {}
        self._demand = Demand(settings.warm.ttl_s)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, settings.parallelism), thread_name_prefix="prepare"
        )

    # -- public surface ---------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        with self._cp_lock:
            return self._cp

    def refused_gpus(self) -> Mapping[str, str]:
        return dict(self._refused)

    def stuck_places(self, gpu_uuid: str) -> frozenset[DevicePlace | None]:
        """Places of the GPU (WHOLE_GPU for the whole device) whose prepare was refused because
        of a foreign instance, since that instance appeared."""
        with self._cp_lock:
            return frozenset(self._stuck.get(gpu_uuid, ()))

    def whole_gpus(self) -> frozenset[str]:
        """UUIDs of the GPUs a checkpointed claim holds whole (in any state): no MIG device on
        them may be offered until the claim is torn down and MIG mode is back."""
        return frozenset(
            d.gpu_uuid for r in self.checkpoint().claims.values() for d in r.devices if not d.is_mig
        )

    def mps_down_devices(self) -> Mapping[str, str]:
        """Device name -> why, for the devices of claims whose MPS daemon was found dead and has
        not been seen answering since (a claim unprepared meanwhile no longer counts)."""
        claims = self.checkpoint().claims
        return {
            name: why
            for uid, (names, why) in list(self._mps_down.items())
            if uid in claims
            for name in names
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        futures = {c.uid: self._pool.submit(self._timed_prepare, c) for c in claims}
        return {uid: f.result() for uid, f in futures.items()}

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        futures = {c.uid: self._pool.submit(self._timed_unprepare, c) for c in claims}
        return {uid: f.result() for uid, f in futures.items()}

    # -- locking and checkpoint helpers ------------------------------------------------------

    @contextmanager
    def _lock(self, table: dict[str, threading.Lock], key: str) -> Iterator[None]:
        with self._locks_lock:
            lock = table.setdefault(key, threading.Lock())
        with lock:
            yield

    def _save(self, change: Callable[[Checkpoint], Checkpoint]) -> Checkpoint:
        with self._cp_lock:
            new = change(self._cp)
            self._store.save(new)
            self._cp = new
            self._update_instance_gauge(new)
            return new

    def _put(self, record: ClaimRecord) -> ClaimRecord:
        return self._save(lambda cp: cp.with_claim(record)).claims[record.uid]

    def _update_instance_gauge(self, cp: Checkpoint) -> None:
        names: CountBy[str] = CountBy()
        for rec in cp.claims.values():
            for d in rec.devices:
                if d.gi_id is not None and d.profile_id is not None:
                    gpu = self._gpus.get(d.gpu_minor)
                    p = gpu.profile(d.profile_id) if gpu else None
                    names[p.name if p else str(d.profile_id)] += 1
        self.metrics.set_instances(names)
        self.metrics.foreign_instances.set(len(cp.foreign))
        self.metrics.warm_instances.set(len(cp.warm))

    # -- prepare ------------------------------------------------------------------------------

    def _timed_prepare(self, ref: ClaimRef) -> PrepareResult:
        start = self._clock()
        ctx: dict[str, object] = {"claim": f"{ref.namespace}/{ref.name}", "claimUID": ref.uid}
        try:
            with self._lock(self._claim_locks, ref.uid):
                devices = self._prepare_claim(ref, ctx)
            log.info("claim prepared", extra={**ctx, "devices": [d.device_name for d in devices]})
            return PrepareResult(devices=devices)
        except ClaimError as e:
            self.metrics.errors.labels(operation="prepare", reason=e.reason).inc()
            log.warning("prepare failed", extra={**ctx, "reason": e.reason, "error": str(e)})
            return PrepareResult(error=f"{ref}: {e}", reason=e.reason)
        except Exception as e:
            self.metrics.errors.labels(operation="prepare", reason="internal").inc()
            log.exception("prepare failed unexpectedly", extra=ctx)
            return PrepareResult(error=f"{ref}: internal error: {type(e).__name__}: {e}")
        finally:
            self.metrics.prepare_seconds.observe(self._clock() - start)

    def _prepare_claim(self, ref: ClaimRef, ctx: dict[str, object]) -> tuple[PreparedDevice, ...]:
        existing = self.checkpoint().claims.get(ref.uid)
        if existing is not None and existing.state is ClaimState.PREPARE_COMPLETED:
            return _prepared_devices(existing)  # idempotent: the kubelet asked again
        if existing is not None:
            # Left half-done by a failed or crashed attempt: start over from a clean slate.
            self._teardown(existing, ctx)
        claim = self._read_claim(ref)
        ctx["pods"] = list(claim.reserved_for)
        plan = self._plan(claim)
        record = self._put(
            ClaimRecord(
                ref.uid,
                ref.namespace,
                ref.name,
                ClaimState.PREPARE_STARTED,
                tuple(p.record() for p in plan),
            )
        )
        try:
            try:
                self._claims.add_finalizer(ref.namespace, ref.name, ref.uid, self._finalizer)
            except ClaimGoneError as e:
                raise ClaimError("claim-deleted", str(e)) from e
            record = self._put(replace(record, finalizer_added=True))
            for i, p in enumerate(plan):
                record = self._carve(p, record, i, ref)
            record = self._start_mps(plan, record, ctx)
            cdi_ids = self._cdi.write(
                ref.uid,
                self._cdi_devices(plan, record.devices, record.mps),
                self._spec_edits(record),
            )
            done = tuple(
                replace(d, cdi_ids=(c,)) for d, c in zip(record.devices, cdi_ids, strict=True)
            )
            record = self._put(replace(record, state=ClaimState.PREPARE_COMPLETED, devices=done))
        except BaseException:
            current = self.checkpoint().claims.get(ref.uid)
            if current is not None:
                try:
                    self._teardown(current, ctx)
                except Exception:
                    log.exception("rollback failed; will retry", extra=ctx)
            raise
        return _prepared_devices(record)

    def _read_claim(self, ref: ClaimRef) -> ClaimView:
        try:
            claim = self._claims.get(ref.namespace, ref.name)
        except Exception as e:
            raise ClaimError("api", f"cannot read the ResourceClaim from the API: {e}") from e
        if claim is None:
            raise ClaimError("claim-deleted", "ResourceClaim not found (was it deleted?)")
        if claim.uid != ref.uid:
            raise ClaimError(
                "wrong-uid",
                f"ResourceClaim {ref.namespace}/{ref.name} now has UID {claim.uid}, not {ref.uid}"
                " (deleted and recreated?)",
            )
        if claim.deleting:
            raise ClaimError("claim-deleted", "ResourceClaim is being deleted")
        if not claim.allocated:
            raise ClaimError("not-allocated", "ResourceClaim is not allocated")
        return claim

    def _plan(self, claim: ClaimView) -> list[_Planned]:
        ours = claim.results_for(self._s.driver_name)
        if not ours:
            raise ClaimError(
                "no-results",
                f"no device is allocated by driver {self._s.driver_name} "
                f"(allocated: {describe_results(claim.results)})",
            )
        plan: list[_Planned] = []
        used: dict[str, list[Placement | None]] = {}
        for r in ours:
            if r.pool != self._s.pool_name:
                raise ClaimError(
                    "wrong-node",
                    f"device {r.device} is allocated from pool {r.pool!r}, but this is node "
                    f"{self._s.node_name!r} (pool {self._s.pool_name!r})",
                )
            if r.admin_access:
                raise ClaimError("admin-access", f"device {r.device}: adminAccess is not supported")
            try:
                parsed = parse_device_name(r.device)
            except ValueError:
                parsed = None
            gpu = self._gpus.get(parsed.minor) if parsed else None
            if parsed is None or gpu is None:
                raise ClaimError(
                    "unknown-device",
                    f"device {r.device!r} (request {r.request}) is not a device of this node "
                    f"(GPUs: {', '.join(f'gpu-{m}' for m in sorted(self._gpus))})",
                )
            if gpu.uuid in self._refused:
                self._mark_stuck(
                    gpu.uuid,
                    WHOLE_GPU
                    if parsed.profile_id is None or parsed.placement_start is None
                    else (parsed.profile_id, parsed.placement_start),
                )
                raise ClaimError(
                    "gpu-refused",
                    f"{_label(gpu)} is refused: {self._refused[gpu.uuid]}; the node taints the "
                    f"device {self._foreign_taint_key}:NoExecute, so that the pod is evicted "
                    "and placed again elsewhere",
                )
            profile_id, start = parsed.profile_id, parsed.placement_start
            profile = placement = None
            if profile_id is not None:
                profile = gpu.profile(profile_id)
                placement = (
                    next((pl for pl in profile.placements if pl.start == start), None)
                    if profile
                    else None
                )
                if profile is None or placement is None:
                    raise ClaimError(
                        "unknown-device",
                        f"device {r.device!r}: {_label(gpu)} has no MIG profile id {profile_id} "
                        f"with a placement starting at {start}",
                    )
            for other in used.get(gpu.uuid, ()):
                if other is None or placement is None or _overlap(other, placement):
                    raise ClaimError(
                        "conflicting-devices",
                        f"device {r.device!r} overlaps another device of the same claim",
                    )
            used.setdefault(gpu.uuid, []).append(placement)
            try:
                cfg = resolve_config(claim.config, self._s.driver_name, r.request)
            except ConfigError as e:
                raise ClaimError("bad-config", f"invalid opaque config: {e}") from e
            mps = cfg.sharing.mps if cfg.sharing.strategy is SharingStrategy.MPS else None
            if mps is not None:
                self._check_mps(r.device, profile, mps)
            plan.append(_Planned(r, gpu, profile, placement, cfg.container_env(), mps))
        configs = {p.mps for p in plan if p.mps is not None}
        if len(configs) > 1:
            raise ClaimError(
                "mps-config",
                "the claim's requests ask for different MPS settings; one MPS control daemon "
                "serves a claim, so give its requests one mpsConfig",
            )
        return plan

    def _check_mps(self, device: str, profile: ProfileSpec | None, mps: MpsConfig) -> None:
        """MPS settings the node cannot apply, refused before anything is carved."""
        if profile is None:
            raise ClaimError(
                "mps-whole-gpu",
                f"device {device}: MPS sharing is supported on MIG slices only, not on a whole "
                "GPU (carve runs a claim's MPS control daemon on its MIG devices); request a MIG "
                "slice, or use strategy TimeSlicing",
            )
        limit = mps.default_pinned_device_memory_limit_bytes
        if limit is not None and limit > profile.memory_mib * 2**20:
            raise ClaimError(
                "mps-config",
                f"device {device}: mpsConfig.defaultPinnedDeviceMemoryLimit {limit // 2**20}Mi "
                f"is more than the {profile.name} slice's memory ({profile.memory_mib}Mi)",
            )
        if self._mps is None or not self._mps.available:
            raise ClaimError(
                "mps-unavailable",
                f"device {device}: MPS sharing asked for, but this node's plugin has no "
                "nvidia-cuda-mps-control (not in the driver root, or no --driver-root given)",
            )

    # -- MPS ----------------------------------------------------------------------------------

    def _start_mps(
        self, plan: Sequence[_Planned], record: ClaimRecord, ctx: Mapping[str, object]
    ) -> ClaimRecord:
        """Record, start and configure the claim's MPS daemon; PREPARE_COMPLETED waits for it."""
        config = next((p.mps for p in plan if p.mps is not None), None)
        if config is None or self._mps is None:
            return record
        uuids = [
            d.mig_uuid or d.gpu_uuid for p, d in zip(plan, record.devices, strict=True) if p.mps
        ]
        intent = self._mps.intent(record.uid, uuids)
        record = self._put(replace(record, mps=intent))
        try:
            running = self._mps.start(intent, commands_for(config, len(uuids)))
        except MpsError as e:
            raise ClaimError("mps-start-failed", f"starting the MPS control daemon: {e}") from e
        log.info(
            "MPS control daemon started",
            extra={**ctx, "pid": running.pid, "devices": uuids, "pipeDir": running.pipe_dir},
        )
        return self._put(replace(record, mps=running))

    def _spec_edits(self, record: ClaimRecord) -> SpecEdits:
        if record.mps is None or self._mps is None:
            return self._shared
        mount = self._mps.mount(record.mps)
        kept = tuple(m for m in self._shared.mounts if m.container_path != mount.container_path)
        return SpecEdits((*kept, mount), self._shared.hooks)

    def _ensure_mps(self, record: ClaimRecord, ctx: Mapping[str, object], why: str) -> None:
        """Keep a prepared claim's daemon if it answers, else start it again and say so: in
        the log, the errors metric, the claim's devices' health and an Event on the claim."""
        if record.mps is None or self._mps is None:
            return
        if self._mps.answering(record.mps):
            pid = self._mps.pid_of(record.mps)
            if pid != record.mps.pid:
                self._put(replace(record, mps=replace(record.mps, pid=pid)))
            if self._mps_down.pop(record.uid, None) is not None:
                log.info("MPS control daemon answers again", extra={**ctx, "pid": pid})
            return
        self.metrics.errors.labels(operation="reconcile", reason="mps-down").inc()
        log.warning(
            "MPS control daemon of a prepared claim is not running; restarting it",
            extra={**ctx, "pid": record.mps.pid, "when": why},
        )
        served = set(record.mps.visible_devices)
        names = tuple(d.device_name for d in record.devices if (d.mig_uuid or d.gpu_uuid) in served)
        claim = f"{record.namespace}/{record.name}"
        self._mps_down[record.uid] = (
            names,
            f"MPS control daemon of claim {claim} is down (restarting)",
        )
        self._mps.stop(record.mps, forget=False)  # a wedged one; its saved settings stay
        node = self._s.node_name
        try:
            running = self._mps.start(replace(record.mps, pid=None))
        except MpsError as e:
            log.error("MPS control daemon could not be restarted", extra={**ctx, "error": str(e)})
            self._mps_down[record.uid] = (
                names,
                f"MPS control daemon of claim {claim} is down (restart failed: {e})",
            )
            self._event(
                record,
                "MPSDaemonDown",
                f"MPS control daemon on node {node} was found dead ({why}) and could not be "
                f"restarted: {e}",
            )
            return
        log.warning("MPS control daemon restarted", extra={**ctx, "pid": running.pid})
        self._put(replace(record, mps=running))
        self._event(
            record,
            "MPSDaemonRestarted",
            f"MPS control daemon on node {node} was found dead ({why}) and restarted "
            f"(pid {running.pid}); processes that used the old one must reconnect",
        )

    def _event(self, record: ClaimRecord, reason: str, message: str) -> None:
        """A Warning Event on the claim; best effort."""
        if self._events is None:
            return
        try:
            self._events.event(
                record.namespace,
                record.name,
                record.uid,
                type_="Warning",
                reason=reason,
                message=message,
            )
        except Exception as e:
            log.warning(
                "could not post event on claim",
                extra={"claim": f"{record.namespace}/{record.name}", "error": str(e)},
            )

    def _carve(self, p: _Planned, record: ClaimRecord, i: int, ref: ClaimRef) -> ClaimRecord:
        """Carve device `i` of `record`; the new ids are checkpointed before the GPU lock is
        released, so a concurrent teardown can never mistake the fresh instance for an orphan."""
        if p.profile is None or p.placement is None:
            return self._take_whole_gpu(p, record, i)
        with self._lock(self._gpu_locks, p.gpu.uuid):
            whole = self._holder(p.gpu.uuid, record.uid, whole_only=True)
            if whole is not None:
                raise ClaimError(
                    "gpu-taken",
                    f"{p.result.device}: {_label(p.gpu)} is allocated whole to claim "
                    f"{whole.namespace}/{whole.name}; no MIG slice can be carved on it until "
                    "that claim is released",
                )
            d = self._carve_locked(p, record.devices[i], ref)
            new = replace(record, devices=(*record.devices[:i], d, *record.devices[i + 1 :]))
            # One save both records the instance and drops it from the foreign list (adoption)
            # or the warm pool (reuse): it never has two owners, nor none.
            try:
                saved = self._save(
                    lambda cp: (
                        cp.with_claim(new)
                        .with_foreign(
                            tuple(
                                f
                                for f in cp.foreign
                                if not (f.gpu_uuid == d.gpu_uuid and f.gi_id == d.gi_id)
                            )
                        )
                        .with_warm(
                            tuple(
                                w
                                for w in cp.warm
                                if not (w.gpu_uuid == d.gpu_uuid and w.gi_id == d.gi_id)
                            )
                        )
                    )
                ).claims[new.uid]
            except BaseException:
                self._undo_unsaved_carve(d)
                raise
            if d.adopted:
                self._unstick(d.gpu_uuid, (p.profile.id, p.placement.start))
        self._demand.record(p.gpu.uuid, p.profile.id, time.time())
        return saved

    def _undo_unsaved_carve(self, d: DeviceRecord) -> None:
        """The checkpoint could not record a fresh instance: destroy it again (the caller holds
        the GPU lock), because this claim's rollback no longer looks for unrecorded instances
        (that search could take a foreign instance for its own). An adopted or warm instance
        keeps its previous owner, which the failed save did not change."""
        if d.gi_id is None or d.adopted or self.checkpoint().warm_at(d.gpu_uuid, d.gi_id):
            return
        assert d.placement_start is not None and d.placement_size is not None
        try:
            self._backend.destroy(
                d.gpu_uuid,
                d.gi_id,
                expect_profile_id=d.profile_id,
                expect_placement=Placement(d.placement_start, d.placement_size),
            )
        except Exception:
            log.exception(
                "could not destroy a MIG instance the checkpoint failed to record; it will be "
                "found as foreign",
                extra={"gpu": d.gpu_uuid, "giID": d.gi_id, "device": d.device_name},
            )

    def _holder(self, gpu_uuid: str, uid: str, *, whole_only: bool) -> ClaimRecord | None:
        """Another checkpointed claim with a device on the GPU (a whole-GPU one only, if asked)."""
        for r in self.checkpoint().claims.values():
            if r.uid != uid and any(
                d.gpu_uuid == gpu_uuid and not (whole_only and d.is_mig) for d in r.devices
            ):
                return r
        return None

    def _take_whole_gpu(self, p: _Planned, record: ClaimRecord, i: int) -> ClaimRecord:
        """Device `i` is the whole GPU: make sure it is not in MIG mode.

        The intent to restore MIG mode is checkpointed before MIG mode is turned off, so a crash
        at any point leaves a record whose teardown turns it on again (a no-op if it never went
        off)."""
        gpu, device = p.gpu, p.result.device
        with self._lock(self._gpu_locks, gpu.uuid):
            other = self._holder(gpu.uuid, record.uid, whole_only=False)
            if other is not None:
                raise ClaimError(
                    "gpu-taken",
                    f"whole-GPU device {device}: {_label(gpu)} is in use by claim "
                    f"{other.namespace}/{other.name}",
                )
            if not self._backend.mig_enabled(gpu.uuid):
                return record  # MIG mode is off already: nothing to change, nothing to restore
            self._reclaim_where(gpu.uuid, None, ctx={"claimUID": record.uid})
            live = self._backend.instances(gpu.uuid)
            if live:
                if self._note_foreign(gpu, live):
                    self._mark_stuck(gpu.uuid, WHOLE_GPU)
                raise ClaimError(
                    "placement-taken",
                    f"whole-GPU device {device}: {_label(gpu)} has {len(live)} MIG instance(s) "
                    f"(GI {', '.join(str(g.gi_id) for g in live)}); a whole GPU needs MIG mode "
                    "off, which NVML allows only once no instance exists",
                )
            if gpu.mig_toggle_needs_reset:
                raise ClaimError(
                    "mig-mode-on",
                    f"whole-GPU device {device}: {_label(gpu)} is in MIG mode, and on this "
                    "architecture turning MIG mode off needs a GPU reset, which carve does not "
                    "do (it publishes whole-GPU devices only for such GPUs with MIG mode off; "
                    "the node's ResourceSlices were out of date). To use it whole, run "
                    f"`nvidia-smi -i {gpu.uuid} -mig 0` and reset the GPU",
                )
            flagged = replace(record.devices[i], restore_mig=True)
            record = self._put(
                replace(record, devices=(*record.devices[:i], flagged, *record.devices[i + 1 :]))
            )
            try:
                self._backend.disable_mig(gpu.uuid)
            except Exception as e:
                raise ClaimError(
                    "mig-disable-failed",
                    f"whole-GPU device {device}: turning MIG mode off on {_label(gpu)} failed: {e}",
                ) from e
            if self._backend.mig_enabled(gpu.uuid):
                raise ClaimError(
                    "mig-disable-failed",
                    f"whole-GPU device {device}: MIG mode on {_label(gpu)} is still on after "
                    "turning it off",
                )
            log.info(
                "MIG mode turned off for a whole-GPU claim",
                extra={"claimUID": record.uid, "gpu": gpu.uuid, "device": device},
            )
        self._offers_changed()
        return record

    def _restore_mig(self, d: DeviceRecord, ctx: Mapping[str, object]) -> None:
        """Turn MIG mode back on after a whole-GPU claim (idempotent: on already is fine)."""
        with self._lock(self._gpu_locks, d.gpu_uuid):
            try:
                self._backend.enable_mig(d.gpu_uuid)
            except Exception as e:
                raise ClaimError(
                    "mig-restore-failed",
                    f"turning MIG mode back on on GPU {d.gpu_uuid} after whole-GPU device "
                    f"{d.device_name} failed (retried): {e}",
                ) from e
        log.info(
            "MIG mode turned back on after a whole-GPU claim",
            extra={**ctx, "gpu": d.gpu_uuid, "device": d.device_name},
        )

    def _carve_locked(self, p: _Planned, rec: DeviceRecord, ref: ClaimRef) -> DeviceRecord:
        gpu = p.gpu
        assert p.profile is not None and p.placement is not None
        reused = self._reuse_warm(p, rec, ref)
        if reused is not None:
            return reused
        ctx: dict[str, object] = {"claimUID": ref.uid}
        # A warm instance on the allocated memory slices goes first: the controller counted
        # the space as free, so it may not block the claim.
        self._reclaim_where(gpu.uuid, p.placement, ctx)
        self._ensure_mig_mode(gpu)
        # Carve first and look at the GPU only when NVML refuses: listing instances walks every
        # MIG handle, which is the slowest NVML operation there is.
        try:
            try:
                c = self._backend.carve(gpu.uuid, p.profile.id, p.placement.start)
            except PlacementTaken:
                # An engine or the profile's instance limit may be held by a warm instance
                # elsewhere on the GPU: reclaim them all and try once more.
                if not self._reclaim_where(gpu.uuid, None, ctx):
                    raise
                c = self._backend.carve(gpu.uuid, p.profile.id, p.placement.start)
        except PlacementTaken as e:
            return self._placement_conflict(p, rec, ref, e)
        except Exception as e:
            raise ClaimError(
                "carve-failed",
                f"{p.result.device}: creating {p.profile.name} at {_span(p.placement)} on "
                f"{_label(gpu)} failed: {e}",
            ) from e
        return replace(rec, gi_id=c.gi_id, ci_id=c.ci_id, mig_uuid=c.mig_uuid)

    def _placement_conflict(
        self, p: _Planned, rec: DeviceRecord, ref: ClaimRef, cause: Exception
    ) -> DeviceRecord:
        """Explain why the placement is taken, or adopt a matching foreign instance.

        The caller holds the GPU lock and its own carve just failed, so an instance here that no
        record owns is not carve's: it is recorded as foreign at once, not at the next rescan,
        so that nothing (this claim's rollback included) can take it for carve's own, and the
        device is marked stuck: published NoExecute, so that the pod is evicted and placed again
        elsewhere instead of waiting in ContainerCreating for good."""
        gpu = p.gpu
        assert p.profile is not None and p.placement is not None
        place = (p.profile.id, p.placement.start)
        live = self._backend.instances(gpu.uuid)
        foreign = self._note_foreign(gpu, live)
        cp = self.checkpoint()
        for inst in live:
            if not _overlap(inst.placement, p.placement):
                continue
            owner = cp.owner_of(gpu.uuid, inst.gi_id)
            if owner is not None:
                raise ClaimError(
                    "placement-taken",
                    f"{p.result.device}: placement {_span(p.placement)} on {_label(gpu)} is "
                    f"already taken by claim {owner.namespace}/{owner.name}",
                )
        for f in foreign:
            exact = (f.profile_id, f.placement_start) == place
            if exact and self._s.foreign_policy is ForeignPolicy.ADOPT:
                c = self._backend.ensure_compute_instance(gpu.uuid, f.gi_id)
                log.info(
                    "adopted foreign MIG instance",
                    extra={"claimUID": ref.uid, "gpu": gpu.uuid, "giID": f.gi_id},
                )
                return replace(rec, gi_id=c.gi_id, ci_id=c.ci_id, mig_uuid=c.mig_uuid, adopted=True)
        blockers = blocked_places(self._backend.gpu_model(gpu.uuid), foreign).get(place)
        if blockers:
            self._mark_stuck(gpu.uuid, place)
            named = ", ".join(
                describe(f, _profile_name(gpu, f.profile_id))
                for f in foreign
                if f.gi_id in blockers
            )
            raise ClaimError(
                "foreign-instance",
                f"{p.result.device}: {p.profile.name} at {_span(p.placement)} on {_label(gpu)} "
                f"is blocked by MIG instance {named} that carve did not create; foreign-instance "
                f"policy is {self._s.foreign_policy.value}, so carve leaves it alone. The node "
                f"taints the device {self._foreign_taint_key}:NoExecute, so that the pod is "
                "evicted and placed again elsewhere",
            )
        raise ClaimError(
            "placement-taken",
            f"{p.result.device}: creating {p.profile.name} at {_span(p.placement)} on "
            f"{_label(gpu)} failed: {cause}",
        ) from cause

    def _ensure_mig_mode(self, gpu: GpuInfo) -> None:
        if self._backend.mig_enabled(gpu.uuid):
            return
        if gpu.mig_toggle_needs_reset:
            raise ClaimError(
                "mig-disabled",
                f"MIG mode is disabled on {_label(gpu)}; this architecture applies a MIG-mode "
                f"change only after a GPU reset, so carve will not do it: run "
                f"`nvidia-smi -i {gpu.uuid} -mig 1`, reset the GPU, then the claim is retried",
            )
        try:
            self._backend.enable_mig(gpu.uuid)
        except Exception as e:
            raise ClaimError("mig-enable-failed", f"enabling MIG on {_label(gpu)}: {e}") from e
        if not self._backend.mig_enabled(gpu.uuid):
            raise ClaimError(
                "mig-enable-failed", f"MIG mode on {_label(gpu)} is still disabled after enabling"
            )

    def _cdi_devices(
        self,
        plan: Sequence[_Planned],
        records: Sequence[DeviceRecord],
        mps: MpsDaemon | None = None,
    ) -> list[CdiDevice]:
        # The kubelet hands a container the CDI devices of the requests it names
        # (`resources.claims[].request`), all of them when it names none. One environment
        # variable cannot be assembled from several CDI devices (the last one applied wins), so
        # each device names the devices of its own request: exact for a container that uses one
        # request, the count of a request included. Device nodes are exact in every case.
        by_request: dict[str, list[str]] = {}
        for p, r in zip(plan, records, strict=True):
            by_request.setdefault(p.result.request, []).append(r.mig_uuid or r.gpu_uuid)
        out: list[CdiDevice] = []
        for p, r in zip(plan, records, strict=True):
            env = {**p.env, "NVIDIA_VISIBLE_DEVICES": ",".join(by_request[p.result.request])}
            if mps is not None and self._mps is not None and p.mps is not None:
                env.update(self._mps.container_env())
            if r.is_mig:
                assert r.gi_id is not None and r.ci_id is not None
                gi_minor, ci_minor = self._backend.cap_minors(r.gpu_minor, r.gi_id, r.ci_id)
                nodes = mig_device_nodes(
                    gpu_minor=r.gpu_minor,
                    caps_major=self._backend.caps_major(),
                    gi_cap_minor=gi_minor,
                    ci_cap_minor=ci_minor,
                )
            else:
                nodes = whole_gpu_device_nodes(gpu_minor=r.gpu_minor)
            all_nodes = tuple(n.under(self._dev_root) for n in (*nodes, *self._common_nodes))
            out.append(CdiDevice(r.device_name, all_nodes, env))
        return out

    # -- unprepare and teardown ---------------------------------------------------------------

    def _timed_unprepare(self, ref: ClaimRef) -> str:
        start = self._clock()
        ctx = {"claim": f"{ref.namespace}/{ref.name}", "claimUID": ref.uid}
        try:
            with self._lock(self._claim_locks, ref.uid):
                record = self.checkpoint().claims.get(ref.uid)
                if record is None:
                    self._cdi.remove(ref.uid)  # a spec orphaned by a crash, if any
                    return ""
                self._teardown(record, ctx, may_park=record.state is ClaimState.PREPARE_COMPLETED)
            log.info("claim unprepared", extra=ctx)
            return ""
        except ClaimError as e:
            self.metrics.errors.labels(operation="unprepare", reason=e.reason).inc()
            log.warning("unprepare failed", extra={**ctx, "reason": e.reason, "error": str(e)})
            return f"{ref}: {e}"
        except Exception as e:
            self.metrics.errors.labels(operation="unprepare", reason="internal").inc()
            log.exception("unprepare failed unexpectedly", extra=ctx)
            return f"{ref}: internal error: {type(e).__name__}: {e}"
        finally:
            self.metrics.unprepare_seconds.observe(self._clock() - start)

    def _teardown(
        self, record: ClaimRecord, ctx: Mapping[str, object], *, may_park: bool = False
    ) -> None:
        """Destroy the claim's instances, spec and finalizer, then forget the claim. With
        `may_park` (an unprepare of a prepared claim), an instance may be kept warm instead."""
        record = self._put(replace(record, state=ClaimState.UNPREPARE_STARTED))
        if record.mps is not None:
            # Before any slice goes: the daemon serves them. Its record stays until it is gone.
            if self._mps is None:
                raise ClaimError(
                    "mps-unavailable",
                    "the claim's MPS control daemon cannot be stopped: this plugin has no "
                    "nvidia-cuda-mps-control (start it with the same --driver-root)",
                )
            self._mps.stop(record.mps)
            log.info("MPS control daemon stopped", extra={**ctx, "pid": record.mps.pid})
            record = self._put(replace(record, mps=None))
        whole = any(not d.is_mig for d in record.devices)
        for i, d in enumerate(record.devices):
            if d.restore_mig:
                self._restore_mig(d, ctx)
                cleared = replace(d, restore_mig=False)
                record = self._put(
                    replace(
                        record, devices=(*record.devices[:i], cleared, *record.devices[i + 1 :])
                    )
                )
                continue
            if not d.is_mig:
                continue
            if may_park and self._s.warm.enabled and d.gi_id is not None and not d.adopted:
                parked = self._park(record, i, ctx)
                if parked is not None:
                    record = parked
                    continue
            self._destroy_device(d, ctx, by_intent=record.uid in self._inherited)
            cleared = replace(d, gi_id=None, ci_id=None, mig_uuid=None)
            record = self._put(
                replace(record, devices=(*record.devices[:i], cleared, *record.devices[i + 1 :]))
            )
        self._cdi.remove(record.uid)
        if record.finalizer_added:
            try:
                self._claims.remove_finalizer(
                    record.namespace, record.name, record.uid, self._finalizer
                )
            except Exception as e:
                raise ClaimError(
                    "api",
                    f"instances destroyed, but removing finalizer {self._finalizer} failed: {e}",
                ) from e
        self._save(lambda cp: cp.without_claim(record.uid))
        self._inherited.discard(record.uid)
        if whole:
            self._offers_changed()

    def _destroy_device(
        self, d: DeviceRecord, ctx: Mapping[str, object], *, by_intent: bool
    ) -> None:
        """Destroy the device's instance. Without a recorded id, only a claim inherited from an
        earlier process (`by_intent`) looks for it by profile and placement: that process may
        have crashed between the carve and the save. In this process a failed carve leaves
        nothing behind (the backend rolls back, `_undo_unsaved_carve` covers the save), so an
        instance found there now is someone else's."""
        with self._lock(self._gpu_locks, d.gpu_uuid):
            assert d.placement_start is not None and d.placement_size is not None
            if d.gi_id is not None:
                gi_id = d.gi_id
            else:
                if not by_intent or not self._backend.mig_enabled(d.gpu_uuid):
                    return
                live = self._backend.instances(d.gpu_uuid)
                target = _find_own_instance(d, live, self.checkpoint())
                if target is None:
                    return
                gi_id = target.gi_id
            try:
                # The expectations make NVML-side reuse of the GI id harmless: an instance
                # under that id with another profile or placement is not ours and survives.
                self._backend.destroy(
                    d.gpu_uuid,
                    gi_id,
                    expect_profile_id=d.profile_id,
                    expect_placement=Placement(d.placement_start, d.placement_size),
                )
            except InstanceMismatch:
                log.warning(
                    "recorded MIG instance is gone and its id now names another instance",
                    extra={**ctx, "gpu": d.gpu_uuid, "giID": gi_id, "device": d.device_name},
                )
                return
            except Exception as e:
                raise ClaimError(
                    "destroy-failed",
                    f"destroying MIG instance GI {gi_id} of {d.device_name}: {e}",
                ) from e
            log.info(
                "destroyed MIG instance",
                extra={**ctx, "gpu": d.gpu_uuid, "giID": gi_id, "device": d.device_name},
            )

    # -- warm slices (kubeletplugin.warm) -----------------------------------------------------

    def _park(self, record: ClaimRecord, i: int, ctx: Mapping[str, object]) -> ClaimRecord | None:
        """Keep device `i`'s instance warm instead of destroying it, if that is safe and
        predicted useful: the record drops the instance and the warm pool gains it in one save.
        None: destroy it as usual."""
        d = record.devices[i]
        assert d.gi_id is not None and d.profile_id is not None
        with self._lock(self._gpu_locks, d.gpu_uuid):
            if d.mig_uuid is None or d.ci_id is None:
                return None
            try:
                pids = self._backend.running_processes(d.gpu_uuid, d.mig_uuid)
            except NvmlError as e:
                # Unknown is not "none": a slice is only kept when NVML says it is empty.
                log.info(
                    "not keeping MIG instance warm: process query failed",
                    extra={**ctx, "device": d.device_name, "error": str(e)},
                )
                return None
            now = time.time()
            keep, why = keep_verdict(
                self._s.warm,
                processes=pids,
                predicted=self._demand.predicted(d.gpu_uuid, d.profile_id, now),
                warm_on_gpu=sum(1 for w in self.checkpoint().warm if w.gpu_uuid == d.gpu_uuid),
            )
            if not keep:
                log.info(
                    "not keeping MIG instance warm: %s",
                    why,
                    extra={**ctx, "device": d.device_name, "giID": d.gi_id},
                )
                return None
            warm = park(d, record.namespace, now)
            cleared = replace(d, gi_id=None, ci_id=None, mig_uuid=None)
            new = replace(record, devices=(*record.devices[:i], cleared, *record.devices[i + 1 :]))
            saved = self._save(lambda cp: cp.with_claim(new).with_warm((*cp.warm, warm)))
        self.metrics.warm_outcomes.labels(outcome="parked").inc()
        log.info(
            "kept MIG instance warm",
            extra={
                **ctx,
                "device": d.device_name,
                "gpu": d.gpu_uuid,
                "giID": d.gi_id,
                "ttl": self._s.warm.ttl_s,
                "why": why,
            },
        )
        return saved.claims[new.uid]

    def _reuse_warm(self, p: _Planned, rec: DeviceRecord, ref: ClaimRef) -> DeviceRecord | None:
        """The device record with a warm instance taken over, or None (carve as usual). The
        caller holds the GPU lock and saves the record, which also drops the warm entry."""
        assert p.profile is not None and p.placement is not None
        warm = next(
            (
                w
                for w in self.checkpoint().warm
                if reusable_by(
                    w,
                    self._s.warm,
                    gpu_uuid=p.gpu.uuid,
                    profile_id=p.profile.id,
                    placement=p.placement,
                    namespace=ref.namespace,
                )
            ),
            None,
        )
        if warm is None:
            return None
        try:
            pids = self._backend.running_processes(warm.gpu_uuid, warm.mig_uuid)
        except NotFound:
            self._forget_warm(warm, WarmEvent.VANISHED)
            log.warning(
                "warm MIG instance is gone (GPU reset?); carving afresh",
                extra={"claimUID": ref.uid, "gpu": warm.gpu_uuid, "giID": warm.gi_id},
            )
            return None
        except NvmlError as e:
            log.info(
                "warm MIG instance not reused: process query failed; reclaiming it",
                extra={"claimUID": ref.uid, "giID": warm.gi_id, "error": str(e)},
            )
            return None
        if pids:
            raise ClaimError(
                "placement-taken",
                f"{p.result.device}: the MIG instance kept warm at {_span(p.placement)} on "
                f"{_label(p.gpu)} (GI {warm.gi_id}) has processes running although no claim "
                f"owns it (pids {', '.join(map(str, pids))}); carve neither hands it to this "
                "claim nor destroys it. Stop those processes; the kubelet retries the claim",
            )
        transition(warm, WarmEvent.REUSE)
        self.metrics.warm_outcomes.labels(outcome="reused").inc()
        log.info(
            "reusing warm MIG instance",
            extra={
                "claimUID": ref.uid,
                "device": p.result.device,
                "gpu": warm.gpu_uuid,
                "giID": warm.gi_id,
                "warmFor": round(time.time() - warm.since, 3),
            },
        )
        return replace(rec, gi_id=warm.gi_id, ci_id=warm.ci_id, mig_uuid=warm.mig_uuid)

    def _forget_warm(self, warm: WarmInstance, event: WarmEvent) -> None:
        transition(warm, event)
        self._save(
            lambda cp: cp.with_warm(
                tuple(w for w in cp.warm if (w.gpu_uuid, w.gi_id) != (warm.gpu_uuid, warm.gi_id))
            )
        )
        if event is WarmEvent.VANISHED:
            self.metrics.warm_outcomes.labels(outcome="vanished").inc()

    def _reclaim_where(
        self, gpu_uuid: str, placement: Placement | None, ctx: Mapping[str, object]
    ) -> int:
        """Destroy the warm instances on `placement` of the GPU (None: all of them); the caller
        holds the GPU lock. Returns how many."""
        found = [w for w in self.checkpoint().warm if in_the_way(w, gpu_uuid, placement)]
        for w in found:
            self._reclaim_locked(w, "reclaimed", ctx)
        return len(found)

    def _reclaim_locked(self, warm: WarmInstance, outcome: str, ctx: Mapping[str, object]) -> None:
        """IDLE -> RECLAIMING (saved) -> destroyed -> forgotten; the caller holds the GPU lock."""
        key = (warm.gpu_uuid, warm.gi_id)
        if warm.state is WarmState.IDLE:
            nxt = transition(warm, WarmEvent.RECLAIM)
            assert nxt is not None
            self._save(
                lambda cp: cp.with_warm(
                    tuple(nxt if (w.gpu_uuid, w.gi_id) == key else w for w in cp.warm)
                )
            )
            warm = nxt
        try:
            self._backend.destroy(
                warm.gpu_uuid,
                warm.gi_id,
                expect_profile_id=warm.profile_id,
                expect_placement=placement_of(warm),
            )
        except InstanceMismatch:
            log.warning(
                "warm MIG instance is gone and its id now names another instance",
                extra={**ctx, "gpu": warm.gpu_uuid, "giID": warm.gi_id},
            )
        except Exception as e:
            raise ClaimError(
                "destroy-failed",
                f"destroying the MIG instance kept warm at {_span(placement_of(warm))} on GPU "
                f"{warm.gpu_uuid} (GI {warm.gi_id}) to make room: {e}",
            ) from e
        self._forget_warm(warm, WarmEvent.DESTROYED)
        self.metrics.warm_outcomes.labels(outcome=outcome).inc()
        log.info(
            "destroyed warm MIG instance (%s)",
            outcome,
            extra={**ctx, "gpu": warm.gpu_uuid, "giID": warm.gi_id},
        )

    def warm_instances(self) -> tuple[WarmInstance, ...]:
        return self.checkpoint().warm

    def reclaim_expired(self) -> None:
        """Housekeeping: destroy warm instances idle past the TTL (all of them when warm slices
        are off), and finish reclaims a failure or crash interrupted."""
        for warm in self.checkpoint().warm:
            try:
                with self._lock(self._gpu_locks, warm.gpu_uuid):
                    # Looked up again under the lock: a prepare may have taken it meanwhile.
                    current = self.checkpoint().warm_at(warm.gpu_uuid, warm.gi_id)
                    if current is None:
                        continue
                    if current.state is WarmState.RECLAIMING:
                        self._reclaim_locked(current, "reclaimed", {})
                    else:
                        now = time.time()
                        wanted = self._demand.predicted(current.gpu_uuid, current.profile_id, now)
                        if expired(current, self._s.warm, now, still_wanted=wanted):
                            self._reclaim_locked(current, "expired", {})
            except Exception as e:
                log.warning(
                    "reclaiming a warm MIG instance failed; will retry",
                    extra={"gpu": warm.gpu_uuid, "giID": warm.gi_id, "error": str(e)},
                )

    def _reconcile_warm(self) -> None:
        """At start-up: drop warm instances that are gone (reboot, GPU reset), then reclaim the
        expired and half-reclaimed ones."""
        for warm in self.checkpoint().warm:
            if warm.state is not WarmState.IDLE:
                continue
            try:
                self._backend.running_processes(warm.gpu_uuid, warm.mig_uuid)
            except NotFound:
                self._forget_warm(warm, WarmEvent.VANISHED)
                log.warning(
                    "warm MIG instance vanished while the plugin was down",
                    extra={"gpu": warm.gpu_uuid, "giID": warm.gi_id},
                )
            except Exception as e:
                log.warning(
                    "could not check a warm MIG instance",
                    extra={"gpu": warm.gpu_uuid, "giID": warm.gi_id, "error": str(e)},
                )
        self.reclaim_expired()

    # -- start-up reconcile ---------------------------------------------------------------------

    def reconcile(self) -> None:
        """Bring checkpoint, NVML and CDI into agreement after a start or a crash."""
        for record in list(self.checkpoint().claims.values()):
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            if record.state is ClaimState.PREPARE_COMPLETED:
                self._ensure_mps(record, ctx, "start-up")
                continue
            log.warning(
                "finishing interrupted operation",
                extra={**ctx, "state": record.state.value, "action": "tear down"},
            )
            try:
                with self._lock(self._claim_locks, record.uid):
                    self._teardown(record, ctx)
            except Exception:
                log.exception("could not finish interrupted operation; will retry", extra=ctx)
        self._reconcile_warm()
        self.rescan_foreign()
        known = set(self.checkpoint().claims)
        for uid in self._cdi.claim_uids_on_disk() - known:
            log.warning("removing orphaned CDI spec", extra={"claimUID": uid})
            self._cdi.remove(uid)
        self._check_completed()

    def retry_pending(self) -> None:
        """Periodic housekeeping: retry teardowns that could not finish (e.g. the API was
        unreachable), and release claims that no longer exist in the API.

        The kubelet unprepares every claim it prepared, but not one whose object was removed
        behind its back (finalizers stripped by hand, kubelet state lost); without this its
        instance would stay carved forever. The same holds for a claim that is no longer
        allocated to this node: the controller freed it because the node was lost (deleted or
        out of service), and it may since be unallocated or allocated elsewhere. Only a definite
        answer counts: the claim is absent, its name belongs to another UID, or its allocation
        names none of this node's devices. A read error leaves everything as it is.
        """
        for record in list(self.checkpoint().claims.values()):
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            try:
                if record.state is ClaimState.PREPARE_COMPLETED:
                    claim = self._claims.get(record.namespace, record.name)
                    why = self._not_ours_any_more(claim, record.uid)
                    if not why:
                        with self._lock(self._claim_locks, record.uid):
                            current = self.checkpoint().claims.get(record.uid)
                            if current is not None and current.state is record.state:
                                self._ensure_mps(current, ctx, "housekeeping")
                        continue
                    log.warning("releasing claim that %s", why, extra=ctx)
                with self._lock(self._claim_locks, record.uid):
                    current = self.checkpoint().claims.get(record.uid)
                    if current is not None and current.state is record.state:
                        self._teardown(current, ctx)
            except Exception as e:
                log.warning("housekeeping of claim failed", extra={**ctx, "error": str(e)})
        self.reclaim_expired()
        self.rescan_foreign()

    def _not_ours_any_more(self, claim: ClaimView | None, uid: str) -> str:
        """Why a prepared claim no longer belongs on this node ("" when it still does)."""
        if claim is None or claim.uid != uid:
            return "no longer exists in the API"
        if not claim.allocated:
            return "is no longer allocated (its node was given up as lost)"
        if not any(r.pool == self._s.pool_name for r in claim.results_for(self._s.driver_name)):
            return "is now allocated to another node (this node was given up as lost)"
        return ""

    def rescan_foreign(self) -> None:
        """Find the MIG instances carve did not create, on every GPU: at start-up and in
        housekeeping, because an admin can create one at any time (kubeletplugin.foreign)."""
        for gpu in self._gpus.values():
            try:
                with self._lock(self._gpu_locks, gpu.uuid):
                    live = (
                        self._backend.instances(gpu.uuid)
                        if self._backend.mig_enabled(gpu.uuid)
                        else ()
                    )
                    self._note_foreign(gpu, live)
            except Exception as e:
                log.warning(
                    "could not look for foreign MIG instances; will retry",
                    extra={"gpu": gpu.uuid, "error": str(e)},
                )

    def _note_foreign(
        self, gpu: GpuInfo, live: Sequence[GpuInstance]
    ) -> tuple[ForeignInstance, ...]:
        """Record the GPU's foreign instances from a listing taken under its lock; returns them.

        An instance is foreign unless a claim record owns its id, the warm pool holds it, or a
        claim inherited half-done from an earlier process may have carved it (its teardown
        decides). New and vanished ones are logged and posted as Node events; what the node
        publishes changes with them."""
        cp = self.checkpoint()
        pending = [
            d
            for uid in self._inherited
            if (r := cp.claims.get(uid)) is not None
            for d in r.devices
            if d.is_mig and d.gi_id is None and d.gpu_uuid == gpu.uuid
        ]
        claimed = {
            inst.gi_id for d in pending if (inst := _find_own_instance(d, live, cp)) is not None
        }
        before = {f.gi_id: f for f in cp.foreign if f.gpu_uuid == gpu.uuid}
        now = time.time()
        found = tuple(
            ForeignInstance(
                gpu.uuid,
                inst.gi_id,
                inst.profile_id,
                inst.placement.start,
                inst.placement.size,
                inst.ci_ids,
                before[inst.gi_id].first_seen if inst.gi_id in before else now,
            )
            for inst in live
            if cp.owner_of(gpu.uuid, inst.gi_id) is None
            and cp.warm_at(gpu.uuid, inst.gi_id) is None
            and inst.gi_id not in claimed
        )
        new = [f for f in found if f.gi_id not in before or _moved(before[f.gi_id], f)]
        gone = [
            f for f in before.values() if all(f.gi_id != g.gi_id or _moved(f, g) for g in found)
        ]
        refuse = bool(found) and self._s.foreign_policy is ForeignPolicy.REFUSE_GPU
        refused_changed = refuse != (gpu.uuid in self._refused)
        if refuse:
            self._refused[gpu.uuid] = (
                "it holds MIG instances carve did not create (policy refuse-gpu); remove them "
                "(the node notices within a minute) or restart the plugin with another "
                "foreign-instance policy"
            )
        else:
            self._refused.pop(gpu.uuid, None)
        if not (new or gone or refused_changed):
            return found
        self._save(
            lambda c: c.with_foreign((*(f for f in c.foreign if f.gpu_uuid != gpu.uuid), *found))
        )
        if not found:
            with self._cp_lock:
                self._stuck.pop(gpu.uuid, None)
        for f in new:
            self._tell_foreign(gpu, f, appeared=True)
        for f in gone:
            self._tell_foreign(gpu, f, appeared=False)
        self._offers_changed()
        return found

    def _tell_foreign(self, gpu: GpuInfo, f: ForeignInstance, *, appeared: bool) -> None:
        what = describe(f, _profile_name(gpu, f.profile_id))
        policy = self._s.foreign_policy
        extra = {
            "gpu": gpu.uuid,
            "giID": f.gi_id,
            "profileID": f.profile_id,
            "placement": f"{f.placement_start}:{f.placement_size}",
            "policy": policy.value,
        }
        if appeared:
            log.warning("foreign MIG instance (not created by carve)", extra=extra)
            doing = {
                ForeignPolicy.LEAVE: "carve leaves it alone and taints the devices it blocks",
                ForeignPolicy.ADOPT: (
                    "a claim allocated exactly its profile and placement adopts it; carve "
                    "taints the other devices it blocks"
                ),
                ForeignPolicy.REFUSE_GPU: "carve refuses the GPU and taints all its devices",
            }[policy]
            message = (
                f"{_label(gpu)} has MIG instance {what} that carve did not create; policy "
                f"{policy.value}: {doing} with {self._foreign_taint_key}:NoSchedule. Destroy it "
                f"(`nvidia-smi mig -i {gpu.minor} -dci -gi {f.gi_id}`, then `nvidia-smi mig -i "
                f"{gpu.minor} -dgi -gi {f.gi_id}`) to give the space back to carve"
            )
            self._node_event("Warning", "ForeignMigInstance", message)
        else:
            log.info("foreign MIG instance is gone", extra=extra)
            self._node_event(
                "Normal",
                "ForeignMigInstanceGone",
                f"{_label(gpu)}: MIG instance {what} that carve did not create is gone; its "
                "devices are offered again",
            )

    def _node_event(self, type_: str, reason: str, message: str) -> None:
        if self._node_events is not None:
            self._node_events.event(
                type_=type_, reason=reason, message=message, action="ForeignInstances"
            )

    @property
    def _foreign_taint_key(self) -> str:
        return Contract(self._s.driver_name).foreign_instance_taint_key

    def _mark_stuck(self, gpu_uuid: str, place: DevicePlace | None) -> None:
        with self._cp_lock:
            places = self._stuck.setdefault(gpu_uuid, set())
            if place in places:
                return
            places.add(place)
        self._offers_changed()

    def _unstick(self, gpu_uuid: str, place: DevicePlace | None) -> None:
        with self._cp_lock:
            self._stuck.get(gpu_uuid, set()).discard(place)

    def _check_completed(self) -> None:
        """Prepared claims whose instances vanished (node reboot, GPU reset) are forgotten.

        Otherwise a later prepare of the same claim would return CDI IDs for MIG devices that
        no longer exist. With every instance gone the record is torn down (spec and finalizer
        too), so the kubelet's next prepare carves afresh; a partial loss is only reported,
        because tearing down the survivors would break a workload that may still run.
        """
        live: dict[str, Sequence[GpuInstance]] = {}
        for record in list(self.checkpoint().claims.values()):
            mig = [d for d in record.devices if d.is_mig and d.gi_id is not None]
            if record.state is not ClaimState.PREPARE_COMPLETED or not mig:
                continue
            missing = []
            for d in mig:
                if d.gpu_uuid not in live:
                    live[d.gpu_uuid] = (
                        self._backend.instances(d.gpu_uuid)
                        if self._backend.mig_enabled(d.gpu_uuid)
                        else ()
                    )
                if _find_own_instance(d, live[d.gpu_uuid], self.checkpoint()) is None:
                    missing.append(d.device_name)
            if not missing:
                continue
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            self.metrics.errors.labels(operation="reconcile", reason="instance-lost").inc()
            log.error(
                "prepared claim's MIG instances are gone (node reboot or GPU reset?)",
                extra={**ctx, "devices": missing, "all": len(missing) == len(mig)},
            )
            if len(missing) == len(mig):
                try:
                    with self._lock(self._claim_locks, record.uid):
                        self._teardown(record, ctx)
                except Exception:
                    log.exception("could not forget the lost claim; will retry", extra=ctx)


def _find_own_instance(
    d: DeviceRecord, live: Sequence[GpuInstance], cp: Checkpoint
) -> GpuInstance | None:
    """The live instance a device record refers to, never one that belongs to someone else.

    By GI id when the record has one (and the instance still sits at the recorded placement: ids
    are reused); otherwise (crash between create and checkpoint) by the recorded intent, unless
    the instance is known foreign.
    """
    for inst in live:
        if inst.placement.start != d.placement_start or inst.profile_id != d.profile_id:
            continue
        if d.gi_id is not None:
            if inst.gi_id == d.gi_id:
                return inst
            continue
        if (
            cp.owner_of(d.gpu_uuid, inst.gi_id) is None
            and cp.foreign_at(d.gpu_uuid, inst.gi_id) is None
            and cp.warm_at(d.gpu_uuid, inst.gi_id) is None
        ):
            return inst
    return None


def _moved(a: ForeignInstance, b: ForeignInstance) -> bool:
    """The same GI id names another instance now (NVML reuses ids)."""
    return (a.profile_id, a.placement_start) != (b.profile_id, b.placement_start)


def _profile_name(gpu: GpuInfo, profile_id: int) -> str | None:
    p = gpu.profile(profile_id)
    return p.name if p else None


def _label(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.minor} ({gpu.product_name}, {gpu.uuid})"


def _overlap(a: Placement, b: Placement) -> bool:
    return a.start < b.end and b.start < a.end


def _span(p: Placement) -> str:
    return f"memory slices {p.start}-{p.end - 1}" if p.size > 1 else f"memory slice {p.start}"


def _prepared_devices(record: ClaimRecord) -> tuple[PreparedDevice, ...]:
    return tuple(
        PreparedDevice(
            request_names=d.request_names,
            pool_name=d.pool_name,
            device_name=d.device_name,
            cdi_device_ids=d.cdi_ids,
        )
        for d in record.devices
    )
