"""Warm slices: MIG instances kept carved after their claim, for the next claim that fits.

The policy (when to keep one, who may take it, when it expires) is pure, in kubeletplugin.warm;
this is the pool as the node keeps it: parking an instance instead of destroying it, handing it
to a claim of the same profile and placement, and destroying it when it expires or its space is
needed. Every change is one checkpoint save, so an instance never has two owners, nor none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from driver.catalog import Placement
from driver.nvml.errors import GpuLost, GpuNotPresent, InstanceMismatch, NotFound, NvmlError
from kubeletplugin.checkpoint import ClaimRecord, DeviceRecord, WarmInstance, WarmState
from kubeletplugin.ledger import Ledger
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.planning import PlannedDevice
from kubeletplugin.ports import ClaimError, ClaimRef, MigBackend
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
from kubeletplugin.wording import gpu_label, span

log = logging.getLogger(__name__)


class WarmPool:
    def __init__(
        self,
        ledger: Ledger,
        backend: MigBackend,
        settings: WarmSettings,
        metrics: PluginMetrics,
    ) -> None:
        self._ledger = ledger
        self._backend = backend
        self._settings = settings
        self._metrics = metrics
        self.demand = Demand(settings.ttl_s)  # recent carves, by GPU and profile: the forecast

    def park(self, record: ClaimRecord, i: int, ctx: Mapping[str, object]) -> ClaimRecord | None:
        """Keep device `i`'s instance warm instead of destroying it, if that is safe and
        predicted useful: the record drops the instance and the warm pool gains it in one save.
        None: destroy it as usual."""
        d = record.devices[i]
        assert d.gi_id is not None and d.profile_id is not None
        with self._ledger.gpu(d.gpu_uuid):
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
                self._settings,
                processes=pids,
                predicted=self.demand.predicted(d.gpu_uuid, d.profile_id, now),
                warm_on_gpu=sum(
                    1 for w in self._ledger.checkpoint().warm if w.gpu_uuid == d.gpu_uuid
                ),
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
            new = record.with_device(i, cleared)
            saved = self._ledger.save(lambda cp: cp.with_claim(new).with_warm((*cp.warm, warm)))
        self._metrics.warm_outcomes.labels(outcome="parked").inc()
        log.info(
            "kept MIG instance warm",
            extra={
                **ctx,
                "device": d.device_name,
                "gpu": d.gpu_uuid,
                "giID": d.gi_id,
                "ttl": self._settings.ttl_s,
                "why": why,
            },
        )
        return saved.claims[new.uid]

    def owe_destroy(self, record: ClaimRecord, i: int) -> ClaimRecord:
        """Device `i`'s claim is released while its GPU is lost: a reset takes the instance,
        but a GPU that answers again without one still has it, and nobody would own it. So the
        pool takes it over as RECLAIMING in the same save that drops it from the claim, and
        destroys it once the GPU answers (or forgets it when the GPU comes back empty)."""
        d = record.devices[i]
        cleared = replace(d, gi_id=None, ci_id=None, mig_uuid=None)
        new = record.with_device(i, cleared)
        if d.gi_id is None or d.ci_id is None or d.mig_uuid is None or d.profile_id is None:
            return self._ledger.put(new)
        owed = replace(park(d, record.namespace, time.time()), state=WarmState.RECLAIMING)
        saved = self._ledger.save(lambda cp: cp.with_claim(new).with_warm((*cp.warm, owed)))
        return saved.claims[new.uid]

    def reuse(self, p: PlannedDevice, rec: DeviceRecord, ref: ClaimRef) -> DeviceRecord | None:
        """The device record with a warm instance taken over, or None (carve as usual). The
        caller holds the GPU lock and saves the record, which also drops the warm entry."""
        assert p.profile is not None and p.placement is not None
        warm = next(
            (
                w
                for w in self._ledger.checkpoint().warm
                if reusable_by(
                    w,
                    self._settings,
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
            self.forget(warm, WarmEvent.VANISHED)
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
                f"{p.result.device}: the MIG instance kept warm at {span(p.placement)} on "
                f"{gpu_label(p.gpu)} (GI {warm.gi_id}) has processes running although no claim "
                f"owns it (pids {', '.join(map(str, pids))}); carve neither hands it to this "
                "claim nor destroys it. Stop those processes; the kubelet retries the claim",
            )
        transition(warm, WarmEvent.REUSE)
        self._metrics.warm_outcomes.labels(outcome="reused").inc()
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

    def forget(self, warm: WarmInstance, event: WarmEvent) -> None:
        transition(warm, event)
        self._ledger.save(
            lambda cp: cp.with_warm(
                tuple(w for w in cp.warm if (w.gpu_uuid, w.gi_id) != (warm.gpu_uuid, warm.gi_id))
            )
        )
        if event is WarmEvent.VANISHED:
            self._metrics.warm_outcomes.labels(outcome="vanished").inc()

    def reclaim_where(
        self, gpu_uuid: str, placement: Placement | None, ctx: Mapping[str, object]
    ) -> int:
        """Destroy the warm instances on `placement` of the GPU (None: all of them); the caller
        holds the GPU lock. Returns how many."""
        found = [w for w in self._ledger.checkpoint().warm if in_the_way(w, gpu_uuid, placement)]
        for w in found:
            self._reclaim_locked(w, "reclaimed", ctx)
        return len(found)

    def _reclaim_locked(self, warm: WarmInstance, outcome: str, ctx: Mapping[str, object]) -> None:
        """IDLE -> RECLAIMING (saved) -> destroyed -> forgotten; the caller holds the GPU lock."""
        key = (warm.gpu_uuid, warm.gi_id)
        if warm.state is WarmState.IDLE:
            nxt = transition(warm, WarmEvent.RECLAIM)
            assert nxt is not None
            self._ledger.save(
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
        except GpuNotPresent:
            self.forget(warm, WarmEvent.VANISHED)
            log.warning(
                "warm MIG instance's GPU is gone, and the instance with it",
                extra={**ctx, "gpu": warm.gpu_uuid, "giID": warm.gi_id},
            )
            return
        except GpuLost as e:
            # Kept RECLAIMING: a reset takes the instance (then the destroy finds it gone), a
            # GPU that answers again without one still has it.
            raise ClaimError(
                "gpu-lost",
                f"the MIG instance at {span(placement_of(warm))} on GPU {warm.gpu_uuid} "
                f"(GI {warm.gi_id}) is destroyed once the GPU answers again: {e}",
            ) from e
        except Exception as e:
            raise ClaimError(
                "destroy-failed",
                f"destroying the MIG instance kept warm at {span(placement_of(warm))} on GPU "
                f"{warm.gpu_uuid} (GI {warm.gi_id}) to make room: {e}",
            ) from e
        self.forget(warm, WarmEvent.DESTROYED)
        self._metrics.warm_outcomes.labels(outcome=outcome).inc()
        log.info(
            "destroyed warm MIG instance (%s)",
            outcome,
            extra={**ctx, "gpu": warm.gpu_uuid, "giID": warm.gi_id},
        )

    def instances(self) -> tuple[WarmInstance, ...]:
        return self._ledger.checkpoint().warm

    def reclaim_expired(self) -> None:
        """Housekeeping: destroy warm instances idle past the TTL (all of them when warm slices
        are off), and finish reclaims a failure or crash interrupted."""
        for warm in self._ledger.checkpoint().warm:
            try:
                with self._ledger.gpu(warm.gpu_uuid):
                    # Looked up again under the lock: a prepare may have taken it meanwhile.
                    current = self._ledger.checkpoint().warm_at(warm.gpu_uuid, warm.gi_id)
                    if current is None:
                        continue
                    if current.state is WarmState.RECLAIMING:
                        self._reclaim_locked(current, "reclaimed", {})
                    else:
                        now = time.time()
                        wanted = self.demand.predicted(current.gpu_uuid, current.profile_id, now)
                        if expired(current, self._settings, now, still_wanted=wanted):
                            self._reclaim_locked(current, "expired", {})
            except Exception as e:
                log.warning(
                    "reclaiming a warm MIG instance failed; will retry",
                    extra={"gpu": warm.gpu_uuid, "giID": warm.gi_id, "error": str(e)},
                )

    def reconcile(self) -> None:
        """At start-up: drop warm instances that are gone (reboot, GPU reset), then reclaim the
        expired and half-reclaimed ones."""
        for warm in self._ledger.checkpoint().warm:
            if warm.state is not WarmState.IDLE:
                continue
            try:
                self._backend.running_processes(warm.gpu_uuid, warm.mig_uuid)
            except (NotFound, GpuLost):
                self.forget(warm, WarmEvent.VANISHED)
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
