"""Finding MIG instances carve did not create, and keeping the node's answer to them current.

What such an instance means for the devices the node publishes is pure and lives in
kubeletplugin.foreign; this is the I/O side. Each GPU is listed under its lock, so an instance a
prepare has just carved but not yet recorded is never mistaken for a foreign one, at start-up,
in housekeeping, and whenever NVML refuses a carve (the caller holds the lock then). Carve never
destroys a foreign instance; it remembers it in the checkpoint, says so in a Node event, and
taints what it blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from driver.contract import Contract
from driver.naming import DevicePlace
from driver.nvml.types import GpuInfo, GpuInstance
from kubeletplugin.checkpoint import ForeignInstance
from kubeletplugin.foreign import ForeignPolicy, describe
from kubeletplugin.ledger import Ledger, find_own_instance
from kubeletplugin.nodeevents import NodeEvents
from kubeletplugin.ports import MigBackend
from kubeletplugin.wording import gpu_label

log = logging.getLogger(__name__)

_REFUSED = (
    "it holds MIG instances carve did not create (policy refuse-gpu); remove them (the node "
    "notices within a minute) or restart the plugin with another foreign-instance policy"
)


class ForeignScanner:
    def __init__(
        self,
        ledger: Ledger,
        backend: MigBackend,
        gpus: Mapping[int, GpuInfo],
        *,
        policy: ForeignPolicy,
        driver_name: str,
        node_events: NodeEvents | None,
        offers_changed: Callable[[], None],
    ) -> None:
        self._ledger = ledger
        self._backend = backend
        self._gpus = gpus
        self.policy = policy
        self.taint_key = Contract(driver_name).foreign_instance_taint_key
        self._node_events = node_events
        self._offers_changed = offers_changed
        self._lock = threading.Lock()
        self._refused: dict[str, str] = {}  # gpu uuid -> why (policy refuse-gpu)
        # gpu uuid -> places (WHOLE_GPU for the whole device) whose prepare a foreign instance
        # refused: published NoExecute so the stuck pod is evicted (kubeletplugin.foreign)
        self._stuck: dict[str, set[DevicePlace | None]] = {}

    def refused_gpus(self) -> Mapping[str, str]:
        with self._lock:
            return dict(self._refused)

    def stuck_places(self, gpu_uuid: str) -> frozenset[DevicePlace | None]:
        """Places of the GPU (WHOLE_GPU for the whole device) whose prepare was refused because
        of a foreign instance, since that instance appeared."""
        with self._lock:
            return frozenset(self._stuck.get(gpu_uuid, ()))

    def mark_stuck(self, gpu_uuid: str, place: DevicePlace | None) -> None:
        with self._lock:
            places = self._stuck.setdefault(gpu_uuid, set())
            if place in places:
                return
            places.add(place)
        self._offers_changed()

    def unstick(self, gpu_uuid: str, place: DevicePlace | None) -> None:
        with self._lock:
            self._stuck.get(gpu_uuid, set()).discard(place)

    def rescan(self) -> None:
        """Find the MIG instances carve did not create, on every GPU: at start-up and in
        housekeeping, because an admin can create one at any time."""
        for gpu in self._gpus.values():
            try:
                with self._ledger.gpu(gpu.uuid):
                    mig = self._backend.mig_enabled(gpu.uuid)
                    self.note(gpu, self._backend.instances(gpu.uuid) if mig else ())
            except Exception as e:
                log.warning(
                    "could not look for foreign MIG instances; will retry",
                    extra={"gpu": gpu.uuid, "error": str(e)},
                )

    def note(self, gpu: GpuInfo, live: Sequence[GpuInstance]) -> tuple[ForeignInstance, ...]:
        """Record the GPU's foreign instances from a listing taken under its lock; returns them.

        An instance is foreign unless a claim record owns it (its GI id and, where recorded, its
        MIG UUID; a record of an earlier boot owns nothing), the warm pool holds it, or a
        claim inherited half-done from an earlier process may have carved it (its teardown
        decides). New and vanished ones are logged and posted as Node events; what the node
        publishes changes with them."""
        cp = self._ledger.checkpoint()
        claimed = {
            inst.gi_id
            for d in self._ledger.pending_intents(gpu.uuid)
            if (inst := find_own_instance(d, live, cp)) is not None
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
            if cp.owner_of(gpu.uuid, inst.gi_id, inst.mig_uuid) is None
            and cp.warm_at(gpu.uuid, inst.gi_id) is None
            and inst.gi_id not in claimed
        )
        new = [f for f in found if f.gi_id not in before or _moved(before[f.gi_id], f)]
        gone = [
            f for f in before.values() if all(f.gi_id != g.gi_id or _moved(f, g) for g in found)
        ]
        refuse = bool(found) and self.policy is ForeignPolicy.REFUSE_GPU
        with self._lock:
            refused_changed = refuse != (gpu.uuid in self._refused)
            if refuse:
                self._refused[gpu.uuid] = _REFUSED
            else:
                self._refused.pop(gpu.uuid, None)
            if not found:
                self._stuck.pop(gpu.uuid, None)
        if not (new or gone or refused_changed):
            return found
        self._ledger.save(
            lambda c: c.with_foreign((*(f for f in c.foreign if f.gpu_uuid != gpu.uuid), *found))
        )
        for f in new:
            self._tell(gpu, f, appeared=True)
        for f in gone:
            self._tell(gpu, f, appeared=False)
        self._offers_changed()
        return found

    def _tell(self, gpu: GpuInfo, f: ForeignInstance, *, appeared: bool) -> None:
        """The log line and the Node event an operator reads about one instance."""
        what = describe(f, gpu)
        extra = {
            "gpu": gpu.uuid,
            "giID": f.gi_id,
            "profileID": f.profile_id,
            "placement": f"{f.placement_start}:{f.placement_size}",
            "policy": self.policy.value,
        }
        if not appeared:
            log.info("foreign MIG instance is gone", extra=extra)
            self._node_event(
                "Normal",
                "ForeignMigInstanceGone",
                f"{gpu_label(gpu)}: MIG instance {what} that carve did not create is gone; its "
                "devices are offered again",
            )
            return
        log.warning("foreign MIG instance (not created by carve)", extra=extra)
        doing = {
            ForeignPolicy.LEAVE: "carve leaves it alone and taints the devices it blocks",
            ForeignPolicy.ADOPT: (
                "a claim allocated exactly its profile and placement adopts it; carve taints "
                "the other devices it blocks"
            ),
            ForeignPolicy.REFUSE_GPU: "carve refuses the GPU and taints all its devices",
        }[self.policy]
        self._node_event(
            "Warning",
            "ForeignMigInstance",
            f"{gpu_label(gpu)} has MIG instance {what} that carve did not create; policy "
            f"{self.policy.value}: {doing} with {self.taint_key}:NoSchedule. Destroy it "
            f"(`nvidia-smi mig -i {gpu.minor} -dci -gi {f.gi_id}`, then `nvidia-smi mig -i "
            f"{gpu.minor} -dgi -gi {f.gi_id}`) to give the space back to carve",
        )

    def _node_event(self, type_: str, reason: str, message: str) -> None:
        if self._node_events is not None:
            self._node_events.event(
                type_=type_, reason=reason, message=message, action="ForeignInstances"
            )


def _moved(a: ForeignInstance, b: ForeignInstance) -> bool:
    """The same GI id names another instance now (NVML reuses ids)."""
    return (a.profile_id, a.placement_start) != (b.profile_id, b.placement_start)
