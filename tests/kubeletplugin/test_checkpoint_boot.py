"""The boot IDs in checkpoint format v1 (docs/checkpoint.md, "Fields added within version 1"):
the file's `data.bootID` and each claim's `bootID`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kubeletplugin.checkpoint import (
    FILE_NAME,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    decode,
    encode,
    v1,
)

BOOT_A = "0f3d7a54-8f7a-4f5e-9d1e-6c1d2b3a4f50"
BOOT_B = "7b1e2c3d-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
_DEVICE = DeviceRecord(
    "gpu-0-mig-1g10gb-19-3", ("r",), "node-a", "GPU-0", 0, 19, 3, 1, 10, 0, "MIG-7", ("c/d",)
)
_CLAIM = ClaimRecord("u1", "ns", "c", ClaimState.PREPARE_COMPLETED, (_DEVICE,), True, 12.5)


def _data(raw: bytes) -> dict[str, object]:
    data = json.loads(raw)["data"]
    assert isinstance(data, dict)
    return data


def test_boot_ids_round_trip_and_are_written_only_when_known() -> None:
    cp = Checkpoint(claims={"u1": replace(_CLAIM, boot_id=BOOT_A)}, boot_id=BOOT_B)
    raw = encode(cp)
    assert decode(raw) == cp
    data = _data(raw)
    assert data["bootID"] == BOOT_B
    claims = data["claims"]
    assert isinstance(claims, dict) and claims["u1"]["bootID"] == BOOT_A
    # unknown: no key at all, so the file is byte for byte what carve 0.1.0 wrote for it
    assert b"bootID" not in encode(Checkpoint(claims={"u1": _CLAIM}))


def test_a_new_record_takes_the_checkpoints_boot_and_an_old_one_keeps_its_own() -> None:
    cp = Checkpoint(boot_id=BOOT_B).with_claim(_CLAIM)
    assert cp.claims["u1"].boot_id == BOOT_B and not cp.of_earlier_boot(cp.claims["u1"])
    old = Checkpoint(boot_id=BOOT_B).with_claim(replace(_CLAIM, boot_id=BOOT_A))
    rec = old.claims["u1"]
    assert rec.boot_id == BOOT_A and old.lost_in_reboot(rec)
    # a record of an earlier boot owns no live instance, whatever its GI id
    assert old.owner_of("GPU-0", 10) is None
    assert cp.owner_of("GPU-0", 10, "MIG-7") is not None
    assert cp.owner_of("GPU-0", 10, "MIG-other") is None  # same GI id, another instance


def test_a_boot_id_that_is_not_a_string_is_damage_named_by_its_place(tmp_path: Path) -> None:
    raw = encode(Checkpoint(claims={"u1": replace(_CLAIM, boot_id=BOOT_A)}, boot_id=BOOT_A))
    doc = json.loads(raw)
    doc["data"]["claims"]["u1"]["bootID"] = 7
    doc["checksum"] = v1.checksum(doc["data"])
    with pytest.raises(CheckpointError, match=r"data.claims\['u1'\].bootID: expected a string"):
        decode(json.dumps(doc).encode())
    doc["data"]["claims"]["u1"]["bootID"] = BOOT_A
    doc["data"]["bootID"] = ["x"]
    doc["checksum"] = v1.checksum(doc["data"])
    bad = json.dumps(doc).encode()
    store = CheckpointStore(tmp_path)
    (tmp_path / FILE_NAME).write_bytes(bad)
    assert store.load() == Checkpoint()  # moved aside, never a crash
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == bad
    assert store.damaged_boot_id is None  # not a string: nothing to salvage


def test_a_damaged_file_still_says_which_boot_wrote_it(tmp_path: Path) -> None:
    raw = encode(Checkpoint(claims={"u1": _CLAIM}, boot_id=BOOT_A))
    doc = json.loads(raw)
    doc["checksum"] = "sha256:00"  # a hand edit
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    store = CheckpointStore(tmp_path)
    assert store.load() == Checkpoint()
    assert store.damaged_boot_id == BOOT_A
