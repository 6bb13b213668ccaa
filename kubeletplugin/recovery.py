"""Bringing the node's records, NVML and CDI back into agreement: at start-up and periodically.

At start-up every claim whose MIG instances died with an earlier boot of the node is released
(the checkpoint's boot ID says so; kubeletplugin.ledger), every claim left half-done is torn
down (finish or roll back), a prepared claim's MPS
daemon is checked, warm instances that vanished are forgotten, foreign instances are found,
orphaned CDI specs are removed, and prepared claims whose instances vanished (reboot, GPU reset)
are forgotten. Housekeeping retries teardowns that failed and releases claims the API no longer
gives this node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from driver.cdi import CdiWriter
from driver.contract import Contract
from driver.nvml.errors import GpuLost, GpuNotPresent
from driver.nvml.types import GpuInfo, GpuInstance
from kubeletplugin.checkpoint import ClaimRecord, ClaimState
from kubeletplugin.claims import ClaimClient, ClaimSnapshot
from kubeletplugin.devicereport import DeviceReport
from kubeletplugin.foreignscan import ForeignScanner
from kubeletplugin.ledger import Ledger, find_own_instance
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.mpsdaemons import ClaimDaemons
from kubeletplugin.nodeevents import NodeEvents
from kubeletplugin.planning import NodeIdentity, PlannedDevice, plan_devices
from kubeletplugin.ports import ClaimError, MigBackend
from kubeletplugin.warmpool import WarmPool

log = logging.getLogger(__name__)

Teardown = Callable[[ClaimRecord, Mapping[str, object]], None]
"""Destroy a claim's instances, spec and finalizer and forget it; the caller holds its lock."""

Complete = Callable[[Sequence[PlannedDevice], ClaimRecord], ClaimRecord]
"""Write a claim's CDI spec and record it PREPARE_COMPLETED."""

Respec = Callable[[ClaimRecord, Mapping[str, object]], ClaimRecord]
"""Write again the CDI spec of a prepared claim whose spec is gone."""


class Recovery:
    def __init__(
        self,
        ledger: Ledger,
        backend: MigBackend,
        gpus: Mapping[int, GpuInfo],
        *,
        node: NodeIdentity,
        claims: ClaimClient,
        cdi: CdiWriter,
        daemons: ClaimDaemons,
        warm: WarmPool,
        foreign: ForeignScanner,
        metrics: PluginMetrics,
        report: DeviceReport,
        teardown: Teardown,
        complete: Complete,
        respec: Respec,
        node_events: NodeEvents | None = None,
    ) -> None:
        self._ledger = ledger
        self._backend = backend
        self._gpus = gpus
        self._node = node
        self._claims = claims
        self._cdi = cdi
        self._daemons = daemons
        self._warm = warm
        self._foreign = foreign
        self._metrics = metrics
        self._report = report
        self._teardown = teardown
        self._complete = complete
        self._respec = respec
        self._node_events = node_events
        self._finalizer = Contract(node.driver_name).node_finalizer(node.node_name)

    def at_start(self) -> None:
        """Bring checkpoint, NVML and CDI into agreement after a start or a crash."""
        for record in list(self._ledger.checkpoint().claims.values()):
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            if self._ledger.checkpoint().lost_in_reboot(record):
                self._release_lost(record, ctx)
                continue
            if record.state is ClaimState.PREPARE_COMPLETED:
                self._daemons.ensure(record, ctx, "start-up")
                continue
            log.warning(
                "finishing interrupted operation",
                extra={**ctx, "state": record.state.value, "action": "tear down"},
            )
            try:
                with self._ledger.claim(record.uid):
                    self._teardown(record, ctx)
            except Exception:
                log.exception("could not finish interrupted operation; will retry", extra=ctx)
        self._warm.reconcile()
        self._rebuild()
        self._foreign.rescan()
        known = set(self._ledger.checkpoint().claims)
        for uid in self._cdi.claim_uids_on_disk() - known:
            log.warning("removing orphaned CDI spec", extra={"claimUID": uid})
            self._cdi.remove(uid)
        self._check_completed()
        self._check_specs()

    def _release_lost(self, record: ClaimRecord, ctx: Mapping[str, object]) -> None:
        """A claim whose MIG instances died with an earlier boot: released as one whose
        instances all vanished is (`_check_completed`), without asking NVML, which can only
        show instances of this boot: an instance a boot-time agent re-created at the same
        placement has the same GI id, and is foreign (the foreign scan records it)."""
        self._metrics.errors.labels(operation="reconcile", reason="instance-lost").inc()
        log.error(
            "prepared claim's MIG instances are gone (node reboot or GPU reset?)",
            extra={
                **ctx,
                "devices": [d.device_name for d in record.devices if d.is_mig],
                "all": True,
                "state": record.state.value,
                "bootID": record.boot_id,
                "why": "the node rebooted since the claim was prepared",
            },
        )
        try:
            with self._ledger.claim(record.uid):
                current = self._ledger.checkpoint().claims.get(record.uid)
                if current is not None:
                    self._teardown(current, ctx)
        except Exception:
            log.exception("could not forget the lost claim; will retry", extra=ctx)

    def _rebuild(self) -> None:
        """After a damaged checkpoint: the claims this node carved for, from the API and NVML.

        Without it the plugin starts empty: every instance of a running pod becomes foreign,
        its CDI spec is removed as an orphan (a restarted container then fails), and no claim
        prepared here ever loses this node's finalizer. The claims carrying that finalizer are
        exactly the ones this node may have carved for; each whose devices all have an
        instance at their placement is recorded prepared again (its spec rewritten), each whose
        instances are not all there loses the finalizer (a half-made one is then foreign)."""
        aside = self._ledger.recovered_from
        if aside is None:
            return
        try:
            held = self._claims.holding(self._finalizer)
        except Exception as e:
            log.error("could not list claims to rebuild the checkpoint", extra={"error": str(e)})
            self._node_event(
                f"the plugin's checkpoint was damaged (kept as {aside}) and the claims to "
                f"rebuild it from could not be listed: {e}; their instances are kept as foreign"
            )
            return
        rebuilt, released = [], []
        # The damaged file still said which boot wrote it, and that was another: every instance
        # it knew died with that boot, so none found now is a claim's (a boot-time agent's, at
        # the same placement, would otherwise be taken for one). Whole GPUs survive a reboot.
        rebooted = self._ledger.previous_boot is not None
        for claim in held:
            name = f"{claim.namespace}/{claim.name}"
            try:
                if self._rebuild_one(claim, rebooted=rebooted):
                    rebuilt.append(name)
                else:
                    self._claims.remove_finalizer(
                        claim.namespace, claim.name, claim.uid, self._finalizer
                    )
                    released.append(name)
            except Exception as e:
                log.warning("could not rebuild a claim", extra={"claim": name, "error": str(e)})
        log.warning(
            "checkpoint rebuilt from the API and NVML",
            extra={"rebuilt": rebuilt, "released": released, "damaged": str(aside)},
        )
        self._node_event(
            f"the plugin's checkpoint was damaged (kept as {aside}); rebuilt from the API and "
            f"NVML: {len(rebuilt)} prepared claim(s) recovered ({', '.join(rebuilt) or 'none'}), "
            f"{len(released)} whose instances were gone released "
            f"({', '.join(released) or 'none'}); other MIG instances are kept as foreign"
        )

    def _rebuild_one(self, claim: ClaimSnapshot, *, rebooted: bool) -> bool:
        """Record one claim prepared again if NVML still has all its devices; False if not
        (always, for a MIG device, when the node `rebooted` since the damaged file)."""
        if not claim.allocated:
            return False
        try:
            plan = plan_devices(
                claim,
                self._node,
                self._gpus,
                refused={},
                mps_available=self._daemons.available,
            )
        except ClaimError:
            return False
        cp = self._ledger.checkpoint()
        devices = []
        for p in plan:
            d = p.record()
            if p.place is None:
                if self._backend.mig_enabled(p.gpu.uuid):
                    return False
                d = replace(d, restore_mig=not p.gpu.mig_toggle_needs_reset)
            else:
                if rebooted:
                    return False
                inst = next(
                    (
                        i
                        for i in self._backend.instances(p.gpu.uuid)
                        if (i.profile_id, i.placement.start) == p.place
                        and cp.owner_of(p.gpu.uuid, i.gi_id, i.mig_uuid) is None
                    ),
                    None,
                )
                if inst is None or inst.mig_uuid is None:
                    return False
                d = replace(d, gi_id=inst.gi_id, ci_id=inst.ci_ids[0], mig_uuid=inst.mig_uuid)
            devices.append(d)
        record = ClaimRecord(
            claim.uid,
            claim.namespace,
            claim.name,
            ClaimState.PREPARE_STARTED,
            tuple(devices),
            finalizer_added=True,
        )
        record = self._ledger.put(self._daemons.adopt(plan, record))
        self._complete(plan, record)
        return True

    def _node_event(self, message: str) -> None:
        if self._node_events is not None:
            self._node_events.event(
                type_="Warning", reason="CheckpointRebuilt", message=message, action="Recover"
            )

    def housekeeping(self) -> None:
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
        for record in list(self._ledger.checkpoint().claims.values()):
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            try:
                lost = self._ledger.checkpoint().lost_in_reboot(record)
                if record.state is ClaimState.PREPARE_COMPLETED and not lost:
                    claim = self._claims.get(record.namespace, record.name)
                    why = self._not_ours_any_more(claim, record.uid)
                    if not why:
                        with self._ledger.claim(record.uid):
                            current = self._ledger.checkpoint().claims.get(record.uid)
                            if current is not None and current.state is record.state:
                                self._daemons.ensure(current, ctx, "housekeeping")
                                if claim is not None and not self._report.known(record.uid):
                                    self._report.tell(current, claim.reserved_for)
                        continue
                    log.warning("releasing claim that %s", why, extra=ctx)
                with self._ledger.claim(record.uid):
                    current = self._ledger.checkpoint().claims.get(record.uid)
                    if current is not None and current.state is record.state:
                        self._teardown(current, ctx)
            except Exception as e:
                log.warning("housekeeping of claim failed", extra={**ctx, "error": str(e)})
        self._warm.reclaim_expired()
        self._foreign.rescan()

    def _not_ours_any_more(self, claim: ClaimSnapshot | None, uid: str) -> str:
        """Why a prepared claim no longer belongs on this node ("" when it still does)."""
        if claim is None or claim.uid != uid:
            return "no longer exists in the API"
        if claim.deleting and not claim.reserved_for:
            # e.g. carve before bind: the pod went after the carve and before its binding, so
            # the kubelet never prepared it here and will never unprepare it
            return "is being deleted and no pod uses it"
        if not claim.allocated:
            return "is no longer allocated (its node was given up as lost)"
        if not any(
            r.pool == self._node.pool_name for r in claim.results_for(self._node.driver_name)
        ):
            return "is now allocated to another node (this node was given up as lost)"
        return ""

    def _check_completed(self) -> None:
        """Prepared claims whose instances vanished (node reboot, GPU reset) are forgotten.

        Otherwise a later prepare of the same claim would return CDI IDs for MIG devices that
        no longer exist. With every instance gone the record is torn down (spec and finalizer
        too), so the kubelet's next prepare carves afresh; a partial loss is only reported,
        because tearing down the survivors would break a workload that may still run. A GPU that
        has fallen off the bus or is gone from the node has none of its instances any more; a
        GPU that cannot be read for another reason is left for the next start.
        """
        live: dict[str, Sequence[GpuInstance] | None] = {}
        for record in list(self._ledger.checkpoint().claims.values()):
            mig = [d for d in record.devices if d.is_mig and d.gi_id is not None]
            if record.state is not ClaimState.PREPARE_COMPLETED or not mig:
                continue
            if self._ledger.checkpoint().lost_in_reboot(record):
                continue  # released at the start (`_release_lost`); its retry is housekeeping
            missing: list[str] = []
            for d in mig:
                if d.gpu_uuid not in live:
                    live[d.gpu_uuid] = self._instances_on(d.gpu_uuid)
                found = live[d.gpu_uuid]
                if found is None:
                    missing = []
                    break
                if find_own_instance(d, found, self._ledger.checkpoint()) is None:
                    missing.append(d.device_name)
            if not missing:
                continue
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            self._metrics.errors.labels(operation="reconcile", reason="instance-lost").inc()
            log.error(
                "prepared claim's MIG instances are gone (node reboot or GPU reset?)",
                extra={**ctx, "devices": missing, "all": len(missing) == len(mig)},
            )
            if len(missing) == len(mig):
                try:
                    with self._ledger.claim(record.uid):
                        self._teardown(record, ctx)
                except Exception:
                    log.exception("could not forget the lost claim; will retry", extra=ctx)

    def _check_specs(self) -> None:
        """Every prepared claim has its CDI spec: one lost with a tmpfs (a reboot) is written
        again from the record, before the kubelet starts the claim's containers again."""
        for record in list(self._ledger.checkpoint().claims.values()):
            if record.state is not ClaimState.PREPARE_COMPLETED:
                continue
            if self._ledger.checkpoint().lost_in_reboot(record):
                continue  # its MIG UUIDs are of an earlier boot: never written into a spec
            if self._cdi.spec_path(record.uid).exists():
                continue
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
            try:
                with self._ledger.claim(record.uid):
                    self._respec(record, ctx)
            except Exception as e:
                # the kubelet's next prepare tries again (the fast path checks the spec too)
                log.warning("could not write a lost CDI spec again", extra={**ctx, "error": str(e)})

    def _instances_on(self, gpu_uuid: str) -> Sequence[GpuInstance] | None:
        """The GPU's instances; none for a GPU lost or gone; None when it cannot be read."""
        try:
            mig = self._backend.mig_enabled(gpu_uuid)
            return self._backend.instances(gpu_uuid) if mig else ()
        except (GpuLost, GpuNotPresent) as e:
            log.warning(
                "a prepared claim's GPU is lost or gone", extra={"gpu": gpu_uuid, "error": str(e)}
            )
            return ()
        except Exception as e:
            log.warning(
                "could not read a prepared claim's GPU", extra={"gpu": gpu_uuid, "error": str(e)}
            )
            return None
