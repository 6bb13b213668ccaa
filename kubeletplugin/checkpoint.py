"""The node agent's durable memory: which claim owns which MIG instance.

The checkpoint is what makes prepare and unprepare crash safe (DESIGN invariants 2 and 3). Each
claim moves through explicit states, and every transition is written to disk *before* the NVML
work it announces:

    (absent) -> PREPARE_STARTED -> PREPARE_COMPLETED -> UNPREPARE_STARTED -> (absent)

PREPARE_STARTED carries the intended GPU, profile and placement of every device, so a restart can
find and roll back an instance that was created but never recorded. PREPARE_COMPLETED adds the
GPU-instance and compute-instance IDs, MIG UUIDs and CDI IDs.

The file is JSON with a SHA-256 checksum over a canonical encoding of its payload, replaced
atomically. A file that fails to parse or verify is moved aside (never deleted: an operator may
need it) and the agent starts from an empty checkpoint and reconciles from NVML.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from driver.cdi import atomic_write

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_NAME = "checkpoint.json"


class CheckpointError(ValueError):
    """The checkpoint file is unreadable, corrupt, or from an unknown format version."""


class ClaimState(StrEnum):
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

    @property
    def is_mig(self) -> bool:
        return self.profile_id is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "deviceName": self.device_name,
            "requestNames": list(self.request_names),
            "poolName": self.pool_name,
            "gpuUUID": self.gpu_uuid,
            "gpuMinor": self.gpu_minor,
            "profileID": self.profile_id,
            "placementStart": self.placement_start,
            "placementSize": self.placement_size,
            "giID": self.gi_id,
            "ciID": self.ci_id,
            "migUUID": self.mig_uuid,
            "cdiIDs": list(self.cdi_ids),
            "adopted": self.adopted,
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> DeviceRecord:
        return DeviceRecord(
            device_name=str(obj["deviceName"]),
            request_names=tuple(obj.get("requestNames") or ()),
            pool_name=str(obj["poolName"]),
            gpu_uuid=str(obj["gpuUUID"]),
            gpu_minor=int(obj["gpuMinor"]),
            profile_id=obj.get("profileID"),
            placement_start=obj.get("placementStart"),
            placement_size=obj.get("placementSize"),
            gi_id=obj.get("giID"),
            ci_id=obj.get("ciID"),
            mig_uuid=obj.get("migUUID"),
            cdi_ids=tuple(obj.get("cdiIDs") or ()),
            adopted=bool(obj.get("adopted", False)),
        )


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[DeviceRecord, ...]
    finalizer_added: bool = False
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state.value,
            "devices": [d.to_json() for d in self.devices],
            "finalizerAdded": self.finalizer_added,
            "updatedAt": self.updated_at,
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> ClaimRecord:
        return ClaimRecord(
            uid=str(obj["uid"]),
            namespace=str(obj["namespace"]),
            name=str(obj["name"]),
            state=ClaimState(obj["state"]),
            devices=tuple(DeviceRecord.from_json(d) for d in obj.get("devices") or ()),
            finalizer_added=bool(obj.get("finalizerAdded", False)),
            updated_at=float(obj.get("updatedAt", 0.0)),
        )


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

    def to_json(self) -> dict[str, Any]:
        return {
            "gpuUUID": self.gpu_uuid,
            "giID": self.gi_id,
            "profileID": self.profile_id,
            "placementStart": self.placement_start,
            "placementSize": self.placement_size,
            "ciIDs": list(self.ci_ids),
            "firstSeen": self.first_seen,
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> ForeignInstance:
        return ForeignInstance(
            gpu_uuid=str(obj["gpuUUID"]),
            gi_id=int(obj["giID"]),
            profile_id=int(obj["profileID"]),
            placement_start=int(obj["placementStart"]),
            placement_size=int(obj["placementSize"]),
            ci_ids=tuple(obj.get("ciIDs") or ()),
            first_seen=float(obj.get("firstSeen", 0.0)),
        )


@dataclass(frozen=True)
class Checkpoint:
    """An immutable snapshot; every change makes a new one that the store then persists."""

    claims: Mapping[str, ClaimRecord] = field(default_factory=dict)
    foreign: tuple[ForeignInstance, ...] = ()

    def with_claim(self, record: ClaimRecord) -> Checkpoint:
        stamped = replace(record, updated_at=time.time())
        return replace(self, claims={**self.claims, record.uid: stamped})

    def without_claim(self, uid: str) -> Checkpoint:
        return replace(self, claims={k: v for k, v in self.claims.items() if k != uid})

    def with_foreign(self, foreign: tuple[ForeignInstance, ...]) -> Checkpoint:
        return replace(self, foreign=foreign)

    def owner_of(self, gpu_uuid: str, gi_id: int) -> ClaimRecord | None:
        for rec in self.claims.values():
            for d in rec.devices:
                if d.gpu_uuid == gpu_uuid and d.gi_id == gi_id:
                    return rec
        return None

    def foreign_at(self, gpu_uuid: str, gi_id: int) -> ForeignInstance | None:
        return next((f for f in self.foreign if f.gpu_uuid == gpu_uuid and f.gi_id == gi_id), None)

    def payload(self) -> dict[str, Any]:
        return {
            "claims": {uid: r.to_json() for uid, r in sorted(self.claims.items())},
            "foreign": [f.to_json() for f in self.foreign],
        }


def _checksum(payload: Mapping[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def encode(cp: Checkpoint) -> bytes:
    payload = cp.payload()
    doc = {"version": FORMAT_VERSION, "checksum": _checksum(payload), "data": payload}
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def decode(raw: bytes) -> Checkpoint:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointError("top level is not an object")
    if doc.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"format version {doc.get('version')!r} is not {FORMAT_VERSION} "
            "(written by a newer or older carve?)"
        )
    payload = doc.get("data")
    if not isinstance(payload, dict) or doc.get("checksum") != _checksum(payload):
        raise CheckpointError("checksum mismatch: the file was modified or partially written")
    try:
        claims = {
            str(uid): ClaimRecord.from_json(r) for uid, r in (payload.get("claims") or {}).items()
        }
        foreign = tuple(ForeignInstance.from_json(f) for f in payload.get("foreign") or ())
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"malformed record: {e!r}") from e
    return Checkpoint(claims=claims, foreign=foreign)


@dataclass
class CheckpointStore:
    """Loads and atomically saves the checkpoint file in `directory`."""

    directory: Path
    recovered_from: Path | None = None  # where a corrupt file was moved, if any

    @property
    def path(self) -> Path:
        return self.directory / FILE_NAME

    def load(self) -> Checkpoint:
        """The saved checkpoint; an empty one if there is none or it is corrupt (moved aside)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return Checkpoint()
        try:
            return decode(raw)
        except CheckpointError as e:
            aside = self.path.with_name(f"{FILE_NAME}.corrupt-{int(time.time() * 1000)}")
            os.replace(self.path, aside)
            self.recovered_from = aside
            log.error(
                "checkpoint corrupt, starting empty and reconciling from NVML",
                extra={"checkpoint": str(self.path), "movedTo": str(aside), "reason": str(e)},
            )
            return Checkpoint()

    def save(self, cp: Checkpoint) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, encode(cp), mode=0o600)
