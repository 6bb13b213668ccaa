"""Format version 1: the checkpoint as carve has written it since the first release.

    {"version": 1, "checksum": "sha256:<hex>", "data": {"claims": {uid: claim}, "foreign": [...],
                                                        "bootID": "<boot id>"}}

The checksum is SHA-256 over the canonical JSON of `data` (sorted keys, no whitespace); it does
not cover `version`. The file is `json.dumps(..., indent=1, sort_keys=True)` plus a newline.
Writing must stay byte-for-byte what carve 0.1.0 wrote, because 0.1.0 reads only this version
and checks it strictly: a node downgraded to it must still find its claims (docs/checkpoint.md).

Reading accepts every file any release has written: optional keys may be missing (a list as
empty, a flag as false, an id as null, a time as 0). A value of the wrong type is damage, and
the error names where it is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Literal, NotRequired, TypedDict, TypeGuard

from kubeletplugin.checkpoint.codec import CheckpointError, Codec
from kubeletplugin.checkpoint.model import (
    Checkpoint,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    ForeignInstance,
    MpsDaemon,
    WarmInstance,
    WarmState,
)

VERSION: Literal[1] = 1

# The state names on disk, spelled out here rather than taken from ClaimState's values, so that
# renaming an internal state cannot change the file format by accident.
_STATE_NAMES: Mapping[ClaimState, str] = {
    ClaimState.PREPARE_STARTED: "PrepareStarted",
    ClaimState.PREPARE_COMPLETED: "PrepareCompleted",
    ClaimState.UNPREPARE_STARTED: "UnprepareStarted",
}
_STATES: Mapping[str, ClaimState] = {name: state for state, name in _STATE_NAMES.items()}
_WARM_STATE_NAMES: Mapping[WarmState, str] = {
    WarmState.IDLE: "Idle",
    WarmState.RECLAIMING: "Reclaiming",
}
_WARM_STATES: Mapping[str, WarmState] = {n: st for st, n in _WARM_STATE_NAMES.items()}


# --- the on-disk shapes -------------------------------------------------------------------


class DeviceV1(TypedDict):
    deviceName: str
    requestNames: list[str]
    poolName: str
    gpuUUID: str
    gpuMinor: int
    profileID: int | None
    placementStart: int | None
    placementSize: int | None
    giID: int | None
    ciID: int | None
    migUUID: str | None
    cdiIDs: list[str]
    adopted: bool
    # Added after 0.1.0 without a new version: written (always true) only for a whole-GPU
    # device whose claim turned MIG mode off, so every other device is byte for byte what 0.1.0
    # wrote, and 0.1.0 (which ignores keys it does not know) still reads the file.
    restoreMigMode: NotRequired[bool]


class MpsV1(TypedDict):
    pipeDir: str
    logDir: str
    visibleDevices: list[str]
    pid: int | None
    # Added later within version 1: written only for a daemon that runs in a pod of its own, so
    # every other record is byte for byte what was written before, and a release without it
    # (which reads keys by name and ignores others) still reads the file.
    pod: NotRequired[str]


class ClaimV1(TypedDict):
    uid: str
    namespace: str
    name: str
    state: str
    devices: list[DeviceV1]
    finalizerAdded: bool
    updatedAt: float
    # Added after 0.1.0 without a new version: written only for a claim with MPS sharing, so a
    # checkpoint without MPS is byte for byte what 0.1.0 wrote, and 0.1.0 (which reads keys by
    # name and ignores others; the checksum covers whatever `data` holds) still reads the file.
    mps: NotRequired[MpsV1]
    # Added after 0.1.0 without a new version: the node's boot ID when the record was started,
    # written whenever it is known. Absent means unknown (every older record); 0.1.0 reads claim
    # keys by name and ignores others (docs/checkpoint.md: why no new version).
    bootID: NotRequired[str]


class ForeignV1(TypedDict):
    gpuUUID: str
    giID: int
    profileID: int
    placementStart: int
    placementSize: int
    ciIDs: list[int]
    firstSeen: float


class WarmV1(TypedDict):
    gpuUUID: str
    gpuMinor: int
    giID: int
    ciID: int
    migUUID: str
    profileID: int
    placementStart: int
    placementSize: int
    namespace: str
    since: float
    state: str


class DataV1(TypedDict):
    claims: dict[str, ClaimV1]
    foreign: list[ForeignV1]
    # Warm instances (kubeletplugin.warm); written only when there are any, so a checkpoint
    # without them is byte for byte what carve 0.1.0 wrote.
    warm: NotRequired[list[WarmV1]]
    # The node's boot ID when the file was written, whenever it is known; absent in every
    # older file (unknown). 0.1.0 reads `claims` and `foreign` by name and ignores other keys.
    bootID: NotRequired[str]


class DocumentV1(TypedDict):
    version: Literal[1]
    checksum: str
    data: DataV1


# --- writing ------------------------------------------------------------------------------


def _device_out(d: DeviceRecord) -> DeviceV1:
    out: DeviceV1 = {
        "deviceName": d.device_name,
        "requestNames": list(d.request_names),
        "poolName": d.pool_name,
        "gpuUUID": d.gpu_uuid,
        "gpuMinor": d.gpu_minor,
        "profileID": d.profile_id,
        "placementStart": d.placement_start,
        "placementSize": d.placement_size,
        "giID": d.gi_id,
        "ciID": d.ci_id,
        "migUUID": d.mig_uuid,
        "cdiIDs": list(d.cdi_ids),
        "adopted": d.adopted,
    }
    if d.restore_mig:
        out["restoreMigMode"] = True
    return out


def _claim_out(r: ClaimRecord) -> ClaimV1:
    out: ClaimV1 = {
        "uid": r.uid,
        "namespace": r.namespace,
        "name": r.name,
        "state": _STATE_NAMES[r.state],
        "devices": [_device_out(d) for d in r.devices],
        "finalizerAdded": r.finalizer_added,
        "updatedAt": r.updated_at,
    }
    if r.mps is not None:
        mps: MpsV1 = {
            "pipeDir": r.mps.pipe_dir,
            "logDir": r.mps.log_dir,
            "visibleDevices": list(r.mps.visible_devices),
            "pid": r.mps.pid,
        }
        if r.mps.pod is not None:
            mps["pod"] = r.mps.pod
        out["mps"] = mps
    if r.boot_id is not None:
        out["bootID"] = r.boot_id
    return out


def _foreign_out(f: ForeignInstance) -> ForeignV1:
    return {
        "gpuUUID": f.gpu_uuid,
        "giID": f.gi_id,
        "profileID": f.profile_id,
        "placementStart": f.placement_start,
        "placementSize": f.placement_size,
        "ciIDs": list(f.ci_ids),
        "firstSeen": f.first_seen,
    }


def _warm_out(w: WarmInstance) -> WarmV1:
    return {
        "gpuUUID": w.gpu_uuid,
        "gpuMinor": w.gpu_minor,
        "giID": w.gi_id,
        "ciID": w.ci_id,
        "migUUID": w.mig_uuid,
        "profileID": w.profile_id,
        "placementStart": w.placement_start,
        "placementSize": w.placement_size,
        "namespace": w.namespace,
        "since": w.since,
        "state": _WARM_STATE_NAMES[w.state],
    }


def checksum(data: Mapping[str, object]) -> str:
    """The `checksum` field for `data`, computed exactly as carve 0.1.0 verifies it."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def encode(cp: Checkpoint) -> bytes:
    data: DataV1 = {
        "claims": {uid: _claim_out(r) for uid, r in sorted(cp.claims.items())},
        "foreign": [_foreign_out(f) for f in cp.foreign],
    }
    if cp.warm:
        data["warm"] = [_warm_out(w) for w in cp.warm]
    if cp.boot_id is not None:
        data["bootID"] = cp.boot_id
    doc: DocumentV1 = {"version": VERSION, "checksum": checksum(data), "data": data}
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


# --- reading ------------------------------------------------------------------------------


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


class _Fields:
    """One JSON object of the file, read key by key; errors say where in the file they are."""

    def __init__(self, obj: object, where: str) -> None:
        if not isinstance(obj, dict):
            raise CheckpointError(f"{where}: expected an object, got {_kind(obj)}")
        self._obj: dict[str, object] = obj
        self.where = where

    def _bad(self, key: str, expected: str) -> CheckpointError:
        value = self._obj[key]
        return CheckpointError(f"{self.where}.{key}: expected {expected}, got {value!r}")

    def _required(self, key: str) -> object:
        if key not in self._obj:
            raise CheckpointError(f"{self.where}: {key!r} is missing")
        return self._obj[key]

    def text(self, key: str) -> str:
        value = self._required(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def integer(self, key: str) -> int:
        value = self._required(key)
        if not _is_int(value):
            raise self._bad(key, "an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        value = self._obj.get(key)
        if value is None:
            return None
        if not _is_int(value):
            raise self._bad(key, "an integer or null")
        return value

    def optional_text(self, key: str) -> str | None:
        value = self._obj.get(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string or null")
        return value

    def flag(self, key: str) -> bool:
        value = self._obj.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def seconds(self, key: str) -> float:
        value = self._obj.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, "a number")
        return float(value)

    def _list(self, key: str) -> list[object]:
        value = self._obj.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._bad(key, "a list")
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        out: list[str] = []
        for v in self._list(key):
            if not isinstance(v, str):
                raise self._bad(key, "a list of strings")
            out.append(v)
        return tuple(out)

    def integers(self, key: str) -> tuple[int, ...]:
        out: list[int] = []
        for v in self._list(key):
            if not _is_int(v):
                raise self._bad(key, "a list of integers")
            out.append(v)
        return tuple(out)

    def objects(self, key: str) -> list[_Fields]:
        return [_Fields(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(self._list(key))]

    def optional_object(self, key: str) -> _Fields | None:
        value = self._obj.get(key)
        return None if value is None else _Fields(value, f"{self.where}.{key}")

    def mapping(self, key: str) -> dict[str, _Fields]:
        value = self._obj.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._bad(key, "an object")
        return {str(k): _Fields(v, f"{self.where}.{key}[{k!r}]") for k, v in value.items()}


def _is_int(value: object) -> TypeGuard[int]:
    """JSON integers only: Python's bool is an int, but `true` is not an id."""
    return isinstance(value, int) and not isinstance(value, bool)


def _device_in(f: _Fields) -> DeviceRecord:
    return DeviceRecord(
        device_name=f.text("deviceName"),
        request_names=f.texts("requestNames"),
        pool_name=f.text("poolName"),
        gpu_uuid=f.text("gpuUUID"),
        gpu_minor=f.integer("gpuMinor"),
        profile_id=f.optional_integer("profileID"),
        placement_start=f.optional_integer("placementStart"),
        placement_size=f.optional_integer("placementSize"),
        gi_id=f.optional_integer("giID"),
        ci_id=f.optional_integer("ciID"),
        mig_uuid=f.optional_text("migUUID"),
        cdi_ids=f.texts("cdiIDs"),
        adopted=f.flag("adopted"),
        restore_mig=f.flag("restoreMigMode"),
    )


def _mps_in(f: _Fields) -> MpsDaemon | None:
    obj = f.optional_object("mps")
    if obj is None:
        return None
    return MpsDaemon(
        pipe_dir=obj.text("pipeDir"),
        log_dir=obj.text("logDir"),
        visible_devices=obj.texts("visibleDevices"),
        pid=obj.optional_integer("pid"),
        pod=obj.optional_text("pod"),
    )


def _claim_in(f: _Fields) -> ClaimRecord:
    state = f.text("state")
    if state not in _STATES:
        raise CheckpointError(
            f"{f.where}.state: {state!r} is not one of {', '.join(sorted(_STATES))}"
        )
    return ClaimRecord(
        uid=f.text("uid"),
        namespace=f.text("namespace"),
        name=f.text("name"),
        state=_STATES[state],
        devices=tuple(_device_in(d) for d in f.objects("devices")),
        finalizer_added=f.flag("finalizerAdded"),
        updated_at=f.seconds("updatedAt"),
        mps=_mps_in(f),
        boot_id=f.optional_text("bootID"),
    )


def _foreign_in(f: _Fields) -> ForeignInstance:
    return ForeignInstance(
        gpu_uuid=f.text("gpuUUID"),
        gi_id=f.integer("giID"),
        profile_id=f.integer("profileID"),
        placement_start=f.integer("placementStart"),
        placement_size=f.integer("placementSize"),
        ci_ids=f.integers("ciIDs"),
        first_seen=f.seconds("firstSeen"),
    )


def _warm_in(f: _Fields) -> WarmInstance:
    state = f.text("state")
    if state not in _WARM_STATES:
        raise CheckpointError(
            f"{f.where}.state: expected one of {', '.join(sorted(_WARM_STATES))}, got {state!r}"
        )
    return WarmInstance(
        gpu_uuid=f.text("gpuUUID"),
        gpu_minor=f.integer("gpuMinor"),
        gi_id=f.integer("giID"),
        ci_id=f.integer("ciID"),
        mig_uuid=f.text("migUUID"),
        profile_id=f.integer("profileID"),
        placement_start=f.integer("placementStart"),
        placement_size=f.integer("placementSize"),
        namespace=f.text("namespace"),
        since=f.seconds("since"),
        state=_WARM_STATES[state],
    )


def decode(doc: Mapping[str, object]) -> Checkpoint:
    data = doc.get("data")
    if not isinstance(data, dict):
        raise CheckpointError(f'"data" is {_kind(data)}, not an object')
    expected = checksum(data)
    if doc.get("checksum") != expected:
        raise CheckpointError(
            f"checksum mismatch (the file says {doc.get('checksum')!r}, its data hashes to "
            f"{expected!r}): the file was modified or partially written"
        )
    top = _Fields(data, "data")
    return Checkpoint(
        claims={uid: _claim_in(c) for uid, c in top.mapping("claims").items()},
        foreign=tuple(_foreign_in(f) for f in top.objects("foreign")),
        warm=tuple(_warm_in(f) for f in top.objects("warm")),
        boot_id=top.optional_text("bootID"),
    )


CODEC = Codec(VERSION, encode, decode)
