"""Prepare and unprepare: the node agent's crash-safe state machine (the ClaimPreparer).

Per claim, every step is announced in the checkpoint before it touches the GPU:

    prepare:    read claim -> plan devices -> PREPARE_STARTED(intents) -> node finalizer
                -> per device: [GPU lock] enable MIG if needed, carve GI at the allocated placement
                   + full CI, record ids -> MPS daemon if asked -> CDI spec -> PREPARE_COMPLETED
    unprepare:  UNPREPARE_STARTED -> stop MPS daemon -> per device: [GPU lock] destroy CI then GI
                (or keep it warm) -> remove CDI spec -> remove node finalizer -> drop record

A failure inside prepare tears down what this attempt built (the same path unprepare takes), so
the kubelet's retry starts clean. After a crash, start-up recovery does the same for every claim
left in PREPARE_STARTED or UNPREPARE_STARTED, so nothing leaks and nothing is carved twice.

The Preparer composes the parts that keep their own state, the way NVIDIA's DeviceState
composes its managers: the ledger (checkpoint and locks, kubeletplugin.ledger), whole GPUs
(kubeletplugin.wholegpu), MPS daemons (kubeletplugin.mpsdaemons), warm slices
(kubeletplugin.warmpool), foreign instances (kubeletplugin.foreignscan) and recovery
(kubeletplugin.recovery). What a claim asks for is checked first, without side effects
(kubeletplugin.planning).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from driver.bootid import BootIdError
from driver.catalog import Placement
from driver.cdi import (
    CdiWriter,
    DeviceNode,
    SpecEdits,
)
from driver.contract import Contract
from driver.nvml.errors import (
    GpuUnresponsive,
    PlacementTaken,
)
from driver.nvml.types import GpuInfo
from kubeletplugin.cdidevices import NodeDevices, cdi_devices
from kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    WarmInstance,
)
from kubeletplugin.claims import ClaimClient, ClaimEvents, ClaimGoneError, ClaimSnapshot
from kubeletplugin.devicereport import DeviceReport
from kubeletplugin.foreign import ForeignPolicy, blocked_places, describe
from kubeletplugin.foreignscan import ForeignScanner
from kubeletplugin.instancedestroy import InstanceDestroyer
from kubeletplugin.ledger import Ledger
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.mps import MpsControl
from kubeletplugin.mpsdaemons import ClaimDaemons
from kubeletplugin.nodeevents import NodeEvents
from kubeletplugin.planning import GpuRefusedError, NodeIdentity, PlannedDevice, plan_devices
from kubeletplugin.ports import (
    ClaimError,
    ClaimRef,
    MigBackend,
    PreparedDevice,
    PrepareResult,
)
from kubeletplugin.recovery import Recovery
from kubeletplugin.warm import WarmSettings
from kubeletplugin.warmpool import WarmPool
from kubeletplugin.wholegpu import WholeGpus
from kubeletplugin.wording import gpu_label, span

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparerSettings:
    driver_name: str
    node_name: str
    pool_name: str
    foreign_policy: ForeignPolicy = ForeignPolicy.LEAVE
    # Above the gRPC server's 16 workers, so that the pool is never what a claim waits for:
    # claims stuck behind a hung GPU (each waits at most --nvml-timeout) must not hold up
    # claims on the node's other GPUs.
    parallelism: int = 32
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
        called when what the node can offer changes (a GPU taken or given back whole, a foreign
        instance found or gone), so that the ResourceSlices are republished at once."""
        self._settings = settings
        self._node = NodeIdentity(settings.driver_name, settings.node_name, settings.pool_name)
        offers_changed = offers_changed or (lambda: None)
        self._node_devices = NodeDevices(tuple(common_nodes), dev_root)
        self._shared = shared_edits or SpecEdits()
        self._backend = backend
        self._claims = claims
        self._cdi = cdi
        self.metrics = metrics or PluginMetrics()
        self._clock = clock
        self._finalizer = Contract(settings.driver_name).node_finalizer(settings.node_name)
        self._gpus: dict[int, GpuInfo] = {g.minor: g for g in backend.gpus()}
        self.ledger = Ledger(store, self.metrics, self._gpus, boot_id=_boot_id(backend))
        self.report = DeviceReport(
            claims,
            self._gpus,
            self.metrics,
            driver=settings.driver_name,
            node=settings.node_name,
        )
        self.warm = WarmPool(self.ledger, backend, settings.warm, self.metrics)
        self._destroyer = InstanceDestroyer(backend, self.ledger)
        self.daemons = ClaimDaemons(
            self.ledger, mps, node_name=settings.node_name, metrics=self.metrics, events=events
        )
        self.foreign = ForeignScanner(
            self.ledger,
            backend,
            self._gpus,
            policy=settings.foreign_policy,
            driver_name=settings.driver_name,
            node_events=node_events,
            offers_changed=offers_changed,
        )
        self._whole = WholeGpus(
            self.ledger,
            backend,
            warm=self.warm,
            foreign=self.foreign,
            offers_changed=offers_changed,
        )
        self._recovery = self._make_recovery(node_events)
        self._offers_changed = offers_changed
        # Why new prepares are refused now, "" while they are not: the controller's contract
        # version out of range (kubeletplugin.controllerskew, set by the composition root).
        self.contract_refusal: Callable[[], str] = lambda: ""
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, settings.parallelism), thread_name_prefix="prepare"
        )

    def _make_recovery(self, node_events: NodeEvents | None) -> Recovery:
        return Recovery(
            self.ledger,
            self._backend,
            self._gpus,
            node=self._node,
            claims=self._claims,
            cdi=self._cdi,
            daemons=self.daemons,
            warm=self.warm,
            foreign=self.foreign,
            metrics=self.metrics,
            report=self.report,
            teardown=self._teardown,
            complete=self._complete,
            respec=self.respec,
            node_events=node_events,
        )

    # -- public surface ---------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        return self.ledger.checkpoint()

    def gpus_changed(self) -> None:
        """Learn GPUs that answer NVML again after being lost at start-up. Every part shares the
        one GPU table, so all of them see the GPU from now on."""
        for g in self._backend.gpus():
            self._gpus.setdefault(g.minor, g)

    def refused_gpus(self) -> Mapping[str, str]:
        return self.foreign.refused_gpus()

    def whole_gpus(self) -> frozenset[str]:
        """UUIDs of the GPUs a checkpointed claim holds whole (kubeletplugin.wholegpu)."""
        return self._whole.held()

    def mps_down_devices(self) -> Mapping[str, str]:
        return self.daemons.down_devices()

    def warm_instances(self) -> tuple[WarmInstance, ...]:
        return self.warm.instances()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        refusal = self.contract_refusal()
        refused: dict[str, PrepareResult] = {}
        if refusal:
            # kubeletplugin.controllerskew: a new allocation is never acted on while its writer
            # may be misread; a claim prepared before is answered from the checkpoint, as ever.
            done = self.checkpoint().claims
            for c in claims:
                rec = done.get(c.uid)
                if rec is None or rec.state is not ClaimState.PREPARE_COMPLETED:
                    refused[c.uid] = PrepareResult(error=f"claim {c}: not prepared: {refusal}")
        futures = {
            c.uid: self._pool.submit(self._timed_prepare, c) for c in claims if c.uid not in refused
        }
        return {**refused, **{uid: f.result() for uid, f in futures.items()}}

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        futures = {c.uid: self._pool.submit(self._timed_unprepare, c) for c in claims}
        return {uid: f.result() for uid, f in futures.items()}

    def reconcile(self) -> None:
        """Bring checkpoint, NVML and CDI into agreement after a start or a crash."""
        self._recovery.at_start()

    def retry_pending(self) -> None:
        """Periodic housekeeping (kubeletplugin.recovery)."""
        self._recovery.housekeeping()

    def reclaim_expired(self) -> None:
        self.warm.reclaim_expired()

    # -- prepare ------------------------------------------------------------------------------

    def _timed_prepare(self, ref: ClaimRef) -> PrepareResult:
        start = self._clock()
        ctx: dict[str, object] = {"claim": f"{ref.namespace}/{ref.name}", "claimUID": ref.uid}
        try:
            with self.ledger.claim(ref.uid):
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
        cp = self.ledger.checkpoint()
        existing = cp.claims.get(ref.uid)
        if (
            existing is not None
            and existing.state is ClaimState.PREPARE_COMPLETED
            and not cp.lost_in_reboot(existing)
        ):
            if not self._cdi.spec_path(ref.uid).exists():
                existing = self.respec(existing, ctx)
            return _prepared_devices(existing)  # idempotent: the kubelet asked again
        if existing is not None:
            # Left half-done by a failed or crashed attempt, or its instances died with an
            # earlier boot: start over from a clean slate.
            self._teardown(existing, ctx)
        claim = self._read_claim(ref)
        ctx["pods"] = list(claim.reserved_for)
        plan = self._plan(claim)
        self._refuse_unresponsive(plan)
        record = self.ledger.put(
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
            record = self.ledger.put(replace(record, finalizer_added=True))
            for i, p in enumerate(plan):
                record = self._carve(p, record, i, ref)
            record = self.daemons.start(plan, record, ctx)
            record = self._complete(plan, record)
        except BaseException:
            current = self.ledger.checkpoint().claims.get(ref.uid)
            if current is not None:
                try:
                    self._teardown(current, ctx)
                except ClaimError as e:  # said: the record stays, housekeeping finishes it
                    log.warning("rollback failed; will retry", extra={**ctx, "error": str(e)})
                except Exception:
                    log.exception("rollback failed; will retry", extra=ctx)
            raise
        self.report.tell(record, claim.reserved_for)
        return _prepared_devices(record)

    def respec(self, record: ClaimRecord, ctx: Mapping[str, object]) -> ClaimRecord:
        """Write again the CDI spec of a prepared claim whose spec is gone: /var/run/cdi is a
        tmpfs on most hosts, so a reboot takes every spec while a whole-GPU claim's record (no
        instance to lose) survives, and its IDs would name a spec that no longer exists. The
        devices come from the record; the claim is read again for its config. Never for a claim
        whose MIG instances died with an earlier boot: its record names MIG UUIDs that no
        longer exist (or, worse, that an instance of someone else's could carry)."""
        self._refuse_lost(record)
        claim = self._read_claim(ClaimRef(record.namespace, record.name, record.uid))
        log.warning("prepared claim's CDI spec is gone (reboot?); writing it again", extra=ctx)
        record = self._complete(self._plan(claim), record)
        self.report.tell(record, claim.reserved_for)
        return record

    def _refuse_lost(self, record: ClaimRecord) -> None:
        if self.ledger.checkpoint().lost_in_reboot(record):
            raise ClaimError(
                "instance-lost",
                f"claim {record.namespace}/{record.name}: its MIG instances were carved in an "
                f"earlier boot of the node (boot ID {record.boot_id}) and are gone; the claim is "
                "released and carved afresh on the kubelet's next prepare",
            )

    def _complete(self, plan: Sequence[PlannedDevice], record: ClaimRecord) -> ClaimRecord:
        """Write the claim's CDI spec, then record it PREPARE_COMPLETED with the spec's ids.
        A spec never names a MIG UUID of an earlier boot (`_refuse_lost`)."""
        self._refuse_lost(record)
        cdi_ids = self._cdi.write(
            record.uid,
            cdi_devices(
                plan,
                record.devices,
                self._backend,
                self._node_devices,
                self.daemons.container_env() if record.mps is not None else None,
            ),
            self.daemons.spec_edits(record, self._shared),
        )
        done = tuple(replace(d, cdi_ids=(c,)) for d, c in zip(record.devices, cdi_ids, strict=True))
        return self.ledger.put(replace(record, state=ClaimState.PREPARE_COMPLETED, devices=done))

    def _read_claim(self, ref: ClaimRef) -> ClaimSnapshot:
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

    def _plan(self, claim: ClaimSnapshot) -> list[PlannedDevice]:
        try:
            return plan_devices(
                claim,
                self._node,
                self._gpus,
                refused=self.foreign.refused_gpus(),
                mps_available=self.daemons.available,
            )
        except GpuRefusedError as e:
            self.foreign.mark_stuck(e.gpu_uuid, e.place)
            raise ClaimError(
                e.reason,
                f"{e}; the node taints the device {self.foreign.taint_key}:NoExecute, so that "
                "the pod is evicted and placed again elsewhere",
            ) from e

    def _refuse_unresponsive(self, plan: Sequence[PlannedDevice]) -> None:
        """A claim on a hung GPU fails at once, before anything is written: the kubelet's
        retries get a clear answer, and no finalizer waits for a GPU that may never answer."""
        hung = {
            u.uuid: u.why for u in self._backend.unusable().values() if u.kind == "unresponsive"
        }
        for p in plan:
            if p.gpu.uuid in hung:
                raise ClaimError("gpu-unresponsive", f"{p.result.device}: {hung[p.gpu.uuid]}")

    def _carve(self, p: PlannedDevice, record: ClaimRecord, i: int, ref: ClaimRef) -> ClaimRecord:
        """Carve device `i` of `record`; the new ids are checkpointed before the GPU lock is
        released, so a concurrent teardown can never mistake the fresh instance for an orphan."""
        if p.profile is None or p.placement is None:
            return self._whole.take(p, record, i)
        with self.ledger.gpu(p.gpu.uuid):
            whole = self._whole.holder(p.gpu.uuid, record.uid, whole_only=True)
            if whole is not None:
                raise ClaimError(
                    "gpu-taken",
                    f"{p.result.device}: {gpu_label(p.gpu)} is allocated whole to claim "
                    f"{whole.namespace}/{whole.name}; no MIG slice can be carved on it until "
                    "that claim is released",
                )
            d = self._carve_locked(p, record.devices[i], ref)
            new = record.with_device(i, d)
            # One save both records the instance and drops it from the foreign list (adoption)
            # or the warm pool (reuse): it never has two owners, nor none.
            try:
                saved = self.ledger.save(
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
                self.foreign.unstick(d.gpu_uuid, (p.profile.id, p.placement.start))
        self.warm.demand.record(p.gpu.uuid, p.profile.id, time.time())
        return saved

    def _undo_unsaved_carve(self, d: DeviceRecord) -> None:
        """The checkpoint could not record a fresh instance: destroy it again (the caller holds
        the GPU lock), because this claim's rollback no longer looks for unrecorded instances
        (that search could take a foreign instance for its own). An adopted or warm instance
        keeps its previous owner, which the failed save did not change."""
        if d.gi_id is None or d.adopted or self.ledger.checkpoint().warm_at(d.gpu_uuid, d.gi_id):
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

    def _carve_locked(self, p: PlannedDevice, rec: DeviceRecord, ref: ClaimRef) -> DeviceRecord:
        gpu = p.gpu
        assert p.profile is not None and p.placement is not None
        reused = self.warm.reuse(p, rec, ref)
        if reused is not None:
            return reused
        ctx: dict[str, object] = {"claimUID": ref.uid}
        # A warm instance on the allocated memory slices goes first: the controller counted
        # the space as free, so it may not block the claim.
        self.warm.reclaim_where(gpu.uuid, p.placement, ctx)
        self._ensure_mig_mode(gpu)
        # Carve first and look at the GPU only when NVML refuses: listing instances walks every
        # MIG handle, which is the slowest NVML operation there is.
        try:
            try:
                c = self._backend.carve(gpu.uuid, p.profile.id, p.placement.start)
            except PlacementTaken:
                # An engine or the profile's instance limit may be held by a warm instance
                # elsewhere on the GPU: reclaim them all and try once more.
                if not self.warm.reclaim_where(gpu.uuid, None, ctx):
                    raise
                c = self._backend.carve(gpu.uuid, p.profile.id, p.placement.start)
        except PlacementTaken as e:
            return self._placement_conflict(p, rec, ref, e)
        except GpuUnresponsive as e:
            self.ledger.unsure(ref.uid)  # the hung call may still carve: find it by intent
            raise ClaimError("gpu-unresponsive", f"{p.result.device}: {e}") from e
        except Exception as e:
            raise ClaimError(
                "carve-failed",
                f"{p.result.device}: creating {p.profile.name} at {span(p.placement)} on "
                f"{gpu_label(gpu)} failed: {e}",
            ) from e
        return replace(rec, gi_id=c.gi_id, ci_id=c.ci_id, mig_uuid=c.mig_uuid)

    def _placement_conflict(
        self, p: PlannedDevice, rec: DeviceRecord, ref: ClaimRef, cause: Exception
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
        foreign = self.foreign.note(gpu, live)
        cp = self.ledger.checkpoint()
        for inst in live:
            if not inst.placement.overlaps(p.placement):
                continue
            owner = cp.owner_of(gpu.uuid, inst.gi_id, inst.mig_uuid)
            if owner is not None:
                raise ClaimError(
                    "placement-taken",
                    f"{p.result.device}: placement {span(p.placement)} on {gpu_label(gpu)} is "
                    f"already taken by claim {owner.namespace}/{owner.name}",
                )
        for f in foreign:
            exact = (f.profile_id, f.placement_start) == place
            if exact and self.foreign.policy is ForeignPolicy.ADOPT:
                c = self._backend.ensure_compute_instance(gpu.uuid, f.gi_id)
                log.info(
                    "adopted foreign MIG instance",
                    extra={"claimUID": ref.uid, "gpu": gpu.uuid, "giID": f.gi_id},
                )
                return replace(rec, gi_id=c.gi_id, ci_id=c.ci_id, mig_uuid=c.mig_uuid, adopted=True)
        blockers = blocked_places(self._backend.gpu_model(gpu.uuid), foreign).get(place)
        if blockers:
            self.foreign.mark_stuck(gpu.uuid, place)
            named = ", ".join(describe(f, gpu) for f in foreign if f.gi_id in blockers)
            raise ClaimError(
                "foreign-instance",
                f"{p.result.device}: {p.profile.name} at {span(p.placement)} on {gpu_label(gpu)} "
                f"is blocked by MIG instance {named} that carve did not create; foreign-instance "
                f"policy is {self.foreign.policy.value}, so carve leaves it alone. The node "
                f"taints the device {self.foreign.taint_key}:NoExecute, so that the pod is "
                "evicted and placed again elsewhere",
            )
        raise ClaimError(
            "placement-taken",
            f"{p.result.device}: creating {p.profile.name} at {span(p.placement)} on "
            f"{gpu_label(gpu)} failed: {cause}",
        ) from cause

    def _ensure_mig_mode(self, gpu: GpuInfo) -> None:
        if self._backend.mig_enabled(gpu.uuid):
            return
        if gpu.mig_toggle_needs_reset:
            raise ClaimError(
                "mig-disabled",
                f"MIG mode is disabled on {gpu_label(gpu)}; this architecture applies a MIG-mode "
                f"change only after a GPU reset, so carve will not do it: run "
                f"`nvidia-smi -i {gpu.uuid} -mig 1`, reset the GPU, then the claim is retried",
            )
        try:
            self._backend.enable_mig(gpu.uuid)
        except Exception as e:
            raise ClaimError("mig-enable-failed", f"enabling MIG on {gpu_label(gpu)}: {e}") from e
        if not self._backend.mig_enabled(gpu.uuid):
            raise ClaimError(
                "mig-enable-failed",
                f"MIG mode on {gpu_label(gpu)} is still disabled after enabling",
            )

    def _timed_unprepare(self, ref: ClaimRef) -> str:
        start = self._clock()
        ctx = {"claim": f"{ref.namespace}/{ref.name}", "claimUID": ref.uid}
        try:
            with self.ledger.claim(ref.uid):
                record = self.ledger.checkpoint().claims.get(ref.uid)
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
        if record.state is not ClaimState.PREPARE_STARTED:  # its devices may have been told
            self.report.forget(record)
        record = self.ledger.put(replace(record, state=ClaimState.UNPREPARE_STARTED))
        record = self.daemons.stop(record, ctx)
        whole = any(not d.is_mig for d in record.devices)
        # Its MIG instances died with an earlier boot: whatever sits at their placements now
        # (a boot-time agent's instance, with the same GI id) is not carve's, so nothing is
        # destroyed, looked for by intent, or kept warm.
        lost = self.ledger.checkpoint().lost_in_reboot(record)
        for i, d in enumerate(record.devices):
            if d.restore_mig:
                self._whole.restore(d, ctx)
                cleared = replace(d, restore_mig=False)
                record = self.ledger.put(record.with_device(i, cleared))
                continue
            if not d.is_mig:
                continue
            if lost:
                if d.gi_id is not None or d.mig_uuid is not None:
                    log.info(
                        "not destroying a MIG instance of an earlier boot: it is gone",
                        extra={**ctx, "gpu": d.gpu_uuid, "giID": d.gi_id, "migUUID": d.mig_uuid},
                    )
                record = self.ledger.put(
                    record.with_device(i, replace(d, gi_id=None, ci_id=None, mig_uuid=None))
                )
                continue
            if may_park and self._settings.warm.enabled and d.gi_id is not None and not d.adopted:
                parked = self.warm.park(record, i, ctx)
                if parked is not None:
                    record = parked
                    continue
            gpu_lost = self._destroyer.destroy(
                d,
                ctx,
                by_intent=self.ledger.inherited(record.uid),
                verify=self.ledger.from_earlier_process(record.uid),
            )
            if gpu_lost and d.gi_id is not None:
                record = self.warm.owe_destroy(record, i)
            else:
                cleared = replace(d, gi_id=None, ci_id=None, mig_uuid=None)
                record = self.ledger.put(record.with_device(i, cleared))
        self._cdi.remove(record.uid)
        # Whether or not `finalizer_added` was saved: the PATCH may have been applied with its
        # answer lost, or the process killed between the PATCH and the save. Removing a
        # finalizer that is not there is a no-op.
        try:
            self._claims.remove_finalizer(
                record.namespace, record.name, record.uid, self._finalizer
            )
        except Exception as e:
            raise ClaimError(
                "api",
                f"instances destroyed, but removing finalizer {self._finalizer} failed: {e}",
            ) from e
        self.ledger.forget(record.uid)
        if whole:
            self._offers_changed()


def _boot_id(backend: MigBackend) -> str | None:
    """The node's boot ID; a boot ID file that cannot be read is logged and taken as unknown
    (reboots are then not told apart, as before boot IDs were kept), never a crash."""
    try:
        return backend.boot_id()
    except (OSError, BootIdError) as e:
        log.error(
            "cannot read the node's boot ID: reboots will not be told apart from restarts "
            "(MIG instances are still matched by their MIG UUIDs)",
            extra={"error": str(e)},
        )
        return None


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
