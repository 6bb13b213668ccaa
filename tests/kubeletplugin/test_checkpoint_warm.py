"""The warm-instance list in checkpoint format v1 (docs/checkpoint.md, "Fields added")."""

from __future__ import annotations

import json

import pytest

from kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointError,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    WarmInstance,
    WarmState,
    decode,
    encode,
    v1,
)

_DEVICE = DeviceRecord(
    "gpu-0-mig-1g10gb-19-3", ("r",), "node-a", "GPU-0", 0, 19, 3, 1, 9, 0, "MIG-9", ("c/d",)
)
_CLAIM = ClaimRecord("u1", "ns", "c", ClaimState.PREPARE_COMPLETED, (_DEVICE,), True, 12.5)
_WARM = WarmInstance("GPU-0", 0, 7, 0, "MIG-7", 19, 4, 1, "ns", 99.5)
_GOOD = {
    "gpuUUID": "GPU-0",
    "gpuMinor": 0,
    "giID": 7,
    "ciID": 0,
    "migUUID": "MIG-7",
    "profileID": 19,
    "placementStart": 4,
    "placementSize": 1,
    "namespace": "ns",
    "since": 99.5,
    "state": "Idle",
}


def _data(raw: bytes) -> dict[str, object]:
    data = json.loads(raw)["data"]
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize("state", list(WarmState))
def test_warm_instances_round_trip(state: WarmState) -> None:
    cp = Checkpoint(claims={"u1": _CLAIM}, warm=(WarmInstance(**{**vars(_WARM), "state": state}),))
    assert decode(encode(cp)) == cp


def test_without_warm_instances_the_file_is_what_0_1_0_wrote() -> None:
    raw = encode(Checkpoint(claims={"u1": _CLAIM}))
    assert b'"warm"' not in raw
    assert decode(raw).warm == ()


def test_what_0_1_0_reads_is_unchanged_by_the_warm_key() -> None:
    """0.1.0 reads `claims` and `foreign` by name, ignores other keys of `data`, and checks
    the checksum over all of `data`: a file with warm instances is valid for it."""
    with_warm = _data(encode(Checkpoint(claims={"u1": _CLAIM}, warm=(_WARM,))))
    without = _data(encode(Checkpoint(claims={"u1": _CLAIM})))
    assert with_warm.pop("warm") == [_GOOD]
    assert with_warm == without
    doc = json.loads(encode(Checkpoint(warm=(_WARM,))))
    assert doc["checksum"] == v1.checksum(doc["data"])


@pytest.mark.parametrize(
    ("warm", "message"),
    [
        ({**_GOOD, "state": "Busy"}, "data.warm[0].state: expected one of Idle, Reclaiming"),
        ({**_GOOD, "giID": "7"}, "data.warm[0].giID: expected an integer"),
        ({k: v for k, v in _GOOD.items() if k != "migUUID"}, "data.warm[0]: 'migUUID' is missing"),
        ("x", "data.warm[0]: expected an object"),
    ],
)
def test_a_malformed_warm_record_is_damage_named_by_its_place(warm: object, message: str) -> None:
    data = _data(encode(Checkpoint()))
    data["warm"] = [warm]
    raw = json.dumps({"version": 1, "checksum": v1.checksum(data), "data": data}).encode()
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode(raw)
