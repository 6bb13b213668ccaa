"""The checkpoint as the node agent's parts share it, and the locks that order their work.

Locks: one per claim UID (the kubelet may retry a claim while an earlier call still runs), one
per GPU (NVML changes to one GPU are serialised; different GPUs proceed in parallel), and one for
the in-memory checkpoint (held only while a new snapshot is saved, never across NVML calls).
Every save goes to disk before the in-memory copy changes, so what the process acts on is never
ahead of what a restart would find.

The ledger also knows which boot of the node this is (driver.bootid). At load it compares the
boot ID the checkpoint was written in with the current one: after a reboot every MIG instance
the records name is gone, even if a boot-time agent has re-created one at the same placement
(with the same GI id, but a new MIG UUID). Claim records keep the boot they were started in
(`ClaimRecord.boot_id`), so that a restart in the middle of cleaning up after a reboot still
knows which records are of the earlier boot; warm and foreign instances of the earlier boot are
dropped at once (they died with it; the foreign scan finds what is there now).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as CountBy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from driver.nvml.types import GpuInfo, GpuInstance
from kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
)
from kubeletplugin.metrics import PluginMetrics

log = logging.getLogger(__name__)


class Ledger:
    def __init__(
        self,
        store: CheckpointStore,
        metrics: PluginMetrics,
        gpus: Mapping[int, GpuInfo],
        *,
        boot_id: str | None = None,
    ) -> None:
        """`boot_id` is the node's boot ID now (None: unknown, reboots are not told apart)."""
        self._store = store
        self._metrics = metrics
        self._gpus = gpus
        loaded = store.load()
        self.previous_boot: str | None = None  # the boot the checkpoint was written in, if other
        self._checkpoint = self._into_boot(loaded, boot_id)
        # Claims left half-done by an earlier process: only their teardown may look for an
        # instance by its intent (one carved just before a crash, before its id was saved).
        self._inherited = {
            uid
            for uid, r in self._checkpoint.claims.items()
            if r.state is not ClaimState.PREPARE_COMPLETED
        }
        # Every claim recorded by an earlier process: its recorded instance is destroyed only
        # once NVML shows the recorded MIG UUID there (someone may have replaced it meanwhile).
        self._from_earlier_process = set(self._checkpoint.claims)
        self._checkpoint_lock = threading.Lock()
        self._locks_lock = threading.Lock()
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._claim_locks: dict[str, threading.Lock] = {}

    def _into_boot(self, loaded: Checkpoint, boot_id: str | None) -> Checkpoint:
        """The loaded checkpoint as of this boot, saved if that changes what is on disk.

        Same boot, or the boot unknown now: as loaded. A file without a boot ID (an older
        release wrote it): its records are taken to be of this boot, since an upgrade rarely
        comes with a reboot, and every recorded instance is still checked by its MIG UUID
        (`find_own_instance`, `owner_of`). Another boot: the records keep theirs, which marks
        them lost (`Checkpoint.lost_in_reboot`); the warm and foreign instances are dropped."""
        damaged = self._store.damaged_boot_id
        if boot_id is not None and damaged is not None and damaged != boot_id:
            self.previous_boot = damaged  # the damaged file's claims are rebuilt from nothing
        if boot_id is None or loaded.boot_id == boot_id:
            return loaded
        claims = {
            uid: r if r.boot_id is not None else replace(r, boot_id=loaded.boot_id or boot_id)
            for uid, r in loaded.claims.items()
        }
        cp = replace(loaded, boot_id=boot_id, claims=claims)
        if loaded.boot_id is None:
            if loaded.claims:
                log.info(
                    "checkpoint has no boot ID (an older release wrote it): taking its claims "
                    "to be of this boot, and checking each recorded instance's MIG UUID",
                    extra={"bootID": boot_id, "claims": len(loaded.claims)},
                )
        else:
            self.previous_boot = loaded.boot_id
            cp = replace(cp, warm=(), foreign=())
            log.warning(
                "the node rebooted since the checkpoint was written: every MIG instance it "
                "names is gone; claims that had MIG instances are released, instances found "
                "now are foreign",
                extra={
                    "previousBootID": loaded.boot_id,
                    "bootID": boot_id,
                    "claimsLost": sorted(
                        f"{r.namespace}/{r.name}"
                        for r in cp.claims.values()
                        if cp.lost_in_reboot(r)
                    ),
                    "warmDropped": len(loaded.warm),
                    "foreignDropped": len(loaded.foreign),
                },
            )
        if loaded.claims or loaded.warm or loaded.foreign:
            self._store.save(cp)
        return cp

    def from_earlier_process(self, uid: str) -> bool:
        """Whether the claim was recorded by an earlier process (loaded at start-up)."""
        return uid in self._from_earlier_process

    @property
    def recovered_from(self) -> Path | None:
        """Where a damaged checkpoint was moved at load (None: it loaded, or there was none)."""
        return self._store.recovered_from

    def checkpoint(self) -> Checkpoint:
        with self._checkpoint_lock:
            return self._checkpoint

    def save(self, change: Callable[[Checkpoint], Checkpoint]) -> Checkpoint:
        """Apply `change` to the current checkpoint, write it, then make it current."""
        with self._checkpoint_lock:
            new = change(self._checkpoint)
            self._store.save(new)
            self._checkpoint = new
            self._update_gauges(new)
            return new

    def put(self, record: ClaimRecord) -> ClaimRecord:
        return self.save(lambda cp: cp.with_claim(record)).claims[record.uid]

    def forget(self, uid: str) -> None:
        """Drop a claim's record once it is torn down."""
        self.save(lambda cp: cp.without_claim(uid))
        with self._checkpoint_lock:
            self._inherited.discard(uid)

    def inherited(self, uid: str) -> bool:
        """Whether the claim's record was left unfinished by an earlier process, or by a carve
        in this one whose answer never came (`unsure`): its instance may exist unrecorded."""
        with self._checkpoint_lock:
            return uid in self._inherited

    def unsure(self, uid: str) -> None:
        """A carve for the claim overran its deadline: NVML may still create the instance when
        the hung call returns, with no id recorded. The claim's teardown then looks for it by
        intent, and nobody else takes an instance there for theirs, as for an inherited claim."""
        with self._checkpoint_lock:
            self._inherited.add(uid)

    def pending_intents(self, gpu_uuid: str) -> list[DeviceRecord]:
        """MIG devices on the GPU of inherited claims with no recorded instance: an instance
        matching one may be that claim's (carved just before a crash), so nobody else claims it
        before that claim's teardown decides."""
        with self._checkpoint_lock:
            cp, uids = self._checkpoint, set(self._inherited)
        return [
            d
            for uid in uids
            if (r := cp.claims.get(uid)) is not None and not cp.of_earlier_boot(r)
            for d in r.devices
            if d.is_mig and d.gi_id is None and d.gpu_uuid == gpu_uuid
        ]

    @contextmanager
    def gpu(self, gpu_uuid: str) -> Iterator[None]:
        """Held across a GPU's NVML changes and the save that records them."""
        with self._lock(self._gpu_locks, gpu_uuid):
            yield

    @contextmanager
    def claim(self, uid: str) -> Iterator[None]:
        """Held across one claim's prepare, unprepare or teardown."""
        with self._lock(self._claim_locks, uid):
            yield

    @contextmanager
    def _lock(self, table: dict[str, threading.Lock], key: str) -> Iterator[None]:
        with self._locks_lock:
            lock = table.setdefault(key, threading.Lock())
        with lock:
            yield

    def _update_gauges(self, cp: Checkpoint) -> None:
        names: CountBy[str] = CountBy()
        for rec in cp.claims.values():
            for d in rec.devices:
                if d.gi_id is not None and d.profile_id is not None:
                    gpu = self._gpus.get(d.gpu_minor)
                    p = gpu.profile(d.profile_id) if gpu else None
                    names[p.name if p else str(d.profile_id)] += 1
        self._metrics.set_instances(names)
        self._metrics.foreign_instances.set(len(cp.foreign))
        self._metrics.warm_instances.set(len(cp.warm))


def find_own_instance(
    d: DeviceRecord, live: Sequence[GpuInstance], cp: Checkpoint
) -> GpuInstance | None:
    """The live instance a device record refers to, never one that belongs to someone else.

    By GI id when the record has one (and the instance still sits at the recorded placement: ids
    are reused) and by identity: a recorded MIG UUID must be the instance's, because an instance
    someone re-created at the same placement gets the same GI id but a new MIG UUID. Otherwise
    (crash between create and checkpoint) by the recorded intent, unless the instance is known
    foreign. The caller never asks for a record of an earlier boot (nothing is its own).
    """
    for inst in live:
        if inst.placement.start != d.placement_start or inst.profile_id != d.profile_id:
            continue
        if d.gi_id is not None:
            if inst.gi_id == d.gi_id and not _other_identity(d, inst):
                return inst
            continue
        if (
            cp.owner_of(d.gpu_uuid, inst.gi_id, inst.mig_uuid) is None
            and cp.foreign_at(d.gpu_uuid, inst.gi_id) is None
            and cp.warm_at(d.gpu_uuid, inst.gi_id) is None
        ):
            return inst
    return None


def _other_identity(d: DeviceRecord, inst: GpuInstance) -> bool:
    """The live instance is provably not the recorded one: both MIG UUIDs known and different.
    (An instance without exactly one compute instance shows no MIG UUID: a destroy cut short,
    still the recorded instance as far as anyone can tell.)"""
    return d.mig_uuid is not None and inst.mig_uuid is not None and inst.mig_uuid != d.mig_uuid
