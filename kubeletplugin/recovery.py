"""Bringing the node's records, NVML and CDI back into agreement: at start-up and periodically.

At start-up every claim left half-done is torn down (finish or roll back), a prepared claim's MPS
daemon is checked, warm instances that vanished are forgotten, foreign instances are found,
orphaned CDI specs are removed, and prepared claims whose instances vanished (reboot, GPU reset)
are forgotten. Housekeeping retries teardowns that failed and releases claims the API no longer
gives this node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from driver.cdi import CdiWriter
from driver.nvml.errors import GpuLost, GpuNotPresent
from driver.nvml.types import GpuInstance
from kubeletplugin.checkpoint import ClaimRecord, ClaimState
from kubeletplugin.claims import ClaimClient, ClaimView
from kubeletplugin.foreignscan import ForeignScanner
from kubeletplugin.ledger import Ledger, find_own_instance
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.mpsdaemons import ClaimDaemons
from kubeletplugin.planning import NodeIdentity
from kubeletplugin.ports import MigBackend
from kubeletplugin.warmpool import WarmPool

log = logging.getLogger(__name__)

Teardown = Callable[[ClaimRecord, Mapping[str, object]], None]
"""Destroy a claim's instances, spec and finalizer and forget it; the caller holds its lock."""


class Recovery:
    def __init__(
        self,
        ledger: Ledger,
        backend: MigBackend,
        *,
        node: NodeIdentity,
        claims: ClaimClient,
        cdi: CdiWriter,
        daemons: ClaimDaemons,
        warm: WarmPool,
        foreign: ForeignScanner,
        metrics: PluginMetrics,
        teardown: Teardown,
    ) -> None:
        self._ledger = ledger
        self._backend = backend
        self._node = node
        self._claims = claims
        self._cdi = cdi
        self._daemons = daemons
        self._warm = warm
        self._foreign = foreign
        self._metrics = metrics
        self._teardown = teardown

    def at_start(self) -> None:
        """Bring checkpoint, NVML and CDI into agreement after a start or a crash."""
        for record in list(self._ledger.checkpoint().claims.values()):
            ctx = {"claim": f"{record.namespace}/{record.name}", "claimUID": record.uid}
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
        self._foreign.rescan()
        known = set(self._ledger.checkpoint().claims)
        for uid in self._cdi.claim_uids_on_disk() - known:
            log.warning("removing orphaned CDI spec", extra={"claimUID": uid})
            self._cdi.remove(uid)
        self._check_completed()

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
                if record.state is ClaimState.PREPARE_COMPLETED:
                    claim = self._claims.get(record.namespace, record.name)
                    why = self._not_ours_any_more(claim, record.uid)
                    if not why:
                        with self._ledger.claim(record.uid):
                            current = self._ledger.checkpoint().claims.get(record.uid)
                            if current is not None and current.state is record.state:
                                self._daemons.ensure(current, ctx, "housekeeping")
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

    def _not_ours_any_more(self, claim: ClaimView | None, uid: str) -> str:
        """Why a prepared claim no longer belongs on this node ("" when it still does)."""
        if claim is None or claim.uid != uid:
            return "no longer exists in the API"
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
