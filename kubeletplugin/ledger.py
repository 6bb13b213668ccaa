"""The checkpoint as the node agent's parts share it, and the locks that order their work.

Locks: one per claim UID (the kubelet may retry a claim while an earlier call still runs), one
per GPU (NVML changes to one GPU are serialised; different GPUs proceed in parallel), and one for
the in-memory checkpoint (held only while a new snapshot is saved, never across NVML calls).
Every save goes to disk before the in-memory copy changes, so what the process acts on is never
ahead of what a restart would find.
"""

from __future__ import annotations

import threading
from collections import Counter as CountBy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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


class Ledger:
    def __init__(
        self, store: CheckpointStore, metrics: PluginMetrics, gpus: Mapping[int, GpuInfo]
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._gpus = gpus
        self._checkpoint = store.load()
        # Claims left half-done by an earlier process: only their teardown may look for an
        # instance by its intent (one carved just before a crash, before its id was saved).
        self._inherited = {
            uid
            for uid, r in self._checkpoint.claims.items()
            if r.state is not ClaimState.PREPARE_COMPLETED
        }
        self._checkpoint_lock = threading.Lock()
        self._locks_lock = threading.Lock()
        self._gpu_locks: dict[str, threading.Lock] = {}
        self._claim_locks: dict[str, threading.Lock] = {}

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
            if (r := cp.claims.get(uid)) is not None
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
