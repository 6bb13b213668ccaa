"""The device record's `restoreMigMode` flag in checkpoint format v1 (docs/checkpoint.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointError,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    decode,
    encode,
    v1,
)

_WHOLE = DeviceRecord("gpu-0", ("r",), "node-a", "GPU-0", 0, cdi_ids=("c/d",))
_PLAIN = ClaimRecord("u1", "ns", "c", ClaimState.PREPARE_STARTED, (_WHOLE,), True, 12.5)
_RESTORING = replace(_PLAIN, devices=(replace(_WHOLE, restore_mig=True),))


def _data(raw: bytes) -> dict[str, object]:
    doc = json.loads(raw)
    assert isinstance(doc, dict)
    data = doc["data"]
    assert isinstance(data, dict)
    return data


def test_the_flag_round_trips() -> None:
    cp = Checkpoint(claims={"u1": _RESTORING})
    assert decode(encode(cp)) == cp
    assert decode(encode(cp)).claims["u1"].devices[0].restore_mig


def test_without_the_flag_the_file_is_what_0_1_0_wrote() -> None:
    raw = encode(Checkpoint(claims={"u1": _PLAIN}))
    assert b"restoreMigMode" not in raw
    assert not decode(raw).claims["u1"].devices[0].restore_mig


def test_what_0_1_0_reads_is_unchanged_by_the_flag() -> None:
    """0.1.0 ignores keys it does not know and checksums all of `data`: the file with the flag
    is valid for it and says the same about everything it knows."""
    with_flag = _data(encode(Checkpoint(claims={"u1": _RESTORING})))
    without = _data(encode(Checkpoint(claims={"u1": _PLAIN})))
    claims = with_flag["claims"]
    assert isinstance(claims, dict)
    assert claims["u1"]["devices"][0].pop("restoreMigMode") is True
    assert with_flag == without


def test_a_malformed_flag_is_damage_named_by_its_place() -> None:
    data = _data(encode(Checkpoint(claims={"u1": _RESTORING})))
    claims = data["claims"]
    assert isinstance(claims, dict)
    claims["u1"]["devices"][0]["restoreMigMode"] = "yes"
    raw = json.dumps({"version": 1, "checksum": v1.checksum(data), "data": data}).encode()
    with pytest.raises(
        CheckpointError, match=r"data.claims\['u1'\].devices\[0\].restoreMigMode: expected true"
    ):
        decode(raw)
