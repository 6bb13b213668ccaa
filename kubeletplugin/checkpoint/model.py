"""What the node agent remembers, as the rest of the plugin sees it.

These types know nothing about files. Each on-disk format version has its own codec (`v1`, ...)
that converts between them and its own JSON shape, so that renaming a field or adding a state
here is a code change, while changing what lands on disk is a new format version with the
compatibility rules of `kubeletplugin.checkpoint` (see docs/checkpoint.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum


class ClaimState(StrEnum):
    """Where a claim is in its two-phase life; written before the NVML work it announces."""

    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"
    UNPREPARE_STARTED = "UnprepareStarted"


@dataclass(frozen=True)
class DeviceRecord:
    """One allocated device of a claim: the intent, and once carved, what NVML returned."""

    device_name: str
    request_names: tuple[str, ...]
    pool_name: str
    gpu_uuid: str
    gpu_minor: int
    # None for a whole-GPU device; otherwise the GPU-instance profile id and placement.
    profile_id: int | None = None
    placement_start: int | None = None
    placement_size: int | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    mig_uuid: str | None = None
    cdi_ids: tuple[str, ...] = ()
    adopted: bool = False  # the instance existed before carve (foreign policy "adopt")
    # A whole-GPU device only: this claim turns (or turned) MIG mode off on the GPU and owes
    # turning it on again. Written before the change, cleared after the change back, so a
    # plugin killed anywhere in between restores MIG mode when it tears the claim down.
    restore_mig: bool = False

    @property
    def is_mig(self) -> bool:
        return self.profile_id is not None


@dataclass(frozen=True)
class MpsDaemon:
    """The MPS control daemon a claim with MPS sharing runs on its slices.

    Recorded before the daemon is started, so that a crash in between still leaves its
    directories to be found and its daemon to be told to quit. Where it runs says which of
    `pid` and `pod` is set (kubeletplugin.mps): a child process of the plugin has its pid,
    recorded as soon as it is forked (None until then); a daemon in a pod of its own has that
    pod, named before it is created. Neither is ever read from the pipe directory, which the
    claim's containers can write.
    """

    pipe_dir: str
    log_dir: str
    visible_devices: tuple[str, ...]  # CUDA_VISIBLE_DEVICES: the MIG UUIDs it serves
    pid: int | None = None
    pod: str | None = None  # "<namespace>/<name>" of the daemon's pod


@dataclass(frozen=True)
class ClaimRecord:
    """A claim this node has started to prepare and not yet finished unpreparing."""

    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[DeviceRecord, ...]
    finalizer_added: bool = False
    updated_at: float = 0.0
    mps: MpsDaemon | None = None
    # The node's boot ID when the record was started: its MIG instances were (or would be)
    # carved in that boot, and no MIG instance outlives a reboot. None: written by a release
    # that kept no boot IDs (the ledger stamps it with the boot it assumes, see Ledger).
    boot_id: str | None = None

    def with_device(self, i: int, device: DeviceRecord) -> ClaimRecord:
        """This record with device `i` replaced (the steps of a claim change one at a time)."""
        return replace(self, devices=(*self.devices[:i], device, *self.devices[i + 1 :]))


@dataclass(frozen=True)
class ForeignInstance:
    """A MIG instance found on the node that no checkpointed claim owns."""

    gpu_uuid: str
    gi_id: int
    profile_id: int
    placement_start: int
    placement_size: int
    ci_ids: tuple[int, ...] = ()
    first_seen: float = 0.0


class WarmState(StrEnum):
    """A warm instance's state (kubeletplugin.warm has the transitions).

    IDLE: carved, no claim owns it, no process on it; a claim allocated exactly its profile and
    placement (in its namespace, unless reuse across namespaces is on) takes it over in one
    checkpoint save. RECLAIMING: being destroyed (expired, or its space is needed); never handed
    out again, and a restart finishes the destroy, because a crash may have left it half gone
    (its compute instance destroyed, its GPU instance not).
    """

    IDLE = "idle"
    RECLAIMING = "reclaiming"


@dataclass(frozen=True)
class WarmInstance:
    """A MIG instance a released claim left carved for the next claim of its profile there.

    The node agent owns it (DESIGN invariant 2: exactly one checkpointed owner); the controller
    sees its placement as free, since the claim that held it is released.
    """

    gpu_uuid: str
    gpu_minor: int
    gi_id: int
    ci_id: int
    mig_uuid: str
    profile_id: int
    placement_start: int
    placement_size: int
    namespace: str  # of the claim that released it: reuse is limited to it unless opted out
    since: float  # wall clock when it became warm (expiry is counted from here)
    state: WarmState = WarmState.IDLE


@dataclass(frozen=True)
class Checkpoint:
    """An immutable snapshot; every change makes a new one that the store then persists."""

    claims: Mapping[str, ClaimRecord] = field(default_factory=dict)
    foreign: tuple[ForeignInstance, ...] = ()
    warm: tuple[WarmInstance, ...] = ()
    # The node's boot ID when the file was last written (None: unknown, an older release's
    # file or a node whose kernel publishes none). Foreign and warm instances carry none of
    # their own: they are of this boot, and are dropped when the boot changes.
    boot_id: str | None = None

    def with_claim(self, record: ClaimRecord) -> Checkpoint:
        """`record` saved; a new record (no boot ID yet) is of the checkpoint's boot."""
        boot = record.boot_id if record.boot_id is not None else self.boot_id
        stamped = replace(record, updated_at=time.time(), boot_id=boot)
        return replace(self, claims={**self.claims, record.uid: stamped})

    def of_earlier_boot(self, record: ClaimRecord) -> bool:
        """The record was started in an earlier boot of the node than the checkpoint's, so
        every MIG instance it names died with that boot: none of them may be matched to a live
        instance (by GI id, MIG UUID or intent), destroyed, or written into a CDI spec."""
        return (
            record.boot_id is not None
            and self.boot_id is not None
            and record.boot_id != self.boot_id
        )

    def lost_in_reboot(self, record: ClaimRecord) -> bool:
        """Of an earlier boot and holding MIG devices: its MIG instances are gone. (A claim of
        whole GPUs only survives a reboot: the GPU is the same device.)"""
        return self.of_earlier_boot(record) and any(d.is_mig for d in record.devices)

    def without_claim(self, uid: str) -> Checkpoint:
        return replace(self, claims={k: v for k, v in self.claims.items() if k != uid})

    def with_foreign(self, foreign: tuple[ForeignInstance, ...]) -> Checkpoint:
        return replace(self, foreign=foreign)

    def owner_of(
        self, gpu_uuid: str, gi_id: int, mig_uuid: str | None = None
    ) -> ClaimRecord | None:
        """The claim whose record names the live instance `gi_id` (MIG device `mig_uuid`, when
        known) on the GPU. Matched by identity: a record of an earlier boot owns nothing, and a
        record with a MIG UUID owns only the instance with that UUID, because NVML hands the
        same GI id (and placement) to an instance someone else re-created."""
        for rec in self.claims.values():
            if self.of_earlier_boot(rec):
                continue
            for d in rec.devices:
                if d.gpu_uuid != gpu_uuid or d.gi_id != gi_id:
                    continue
                if mig_uuid is None or d.mig_uuid is None or d.mig_uuid == mig_uuid:
                    return rec
        return None

    def foreign_at(self, gpu_uuid: str, gi_id: int) -> ForeignInstance | None:
        return next((f for f in self.foreign if f.gpu_uuid == gpu_uuid and f.gi_id == gi_id), None)

    def warm_at(self, gpu_uuid: str, gi_id: int) -> WarmInstance | None:
        return next((w for w in self.warm if w.gpu_uuid == gpu_uuid and w.gi_id == gi_id), None)

    def with_warm(self, warm: tuple[WarmInstance, ...]) -> Checkpoint:
        return replace(self, warm=warm)
