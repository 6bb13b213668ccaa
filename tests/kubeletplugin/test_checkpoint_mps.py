"""The claim record's MPS daemon field in checkpoint format v1 (docs/checkpoint.md)."""

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
    MpsDaemon,
    decode,
    encode,
    v1,
)

_DEVICE = DeviceRecord(
    "gpu-0-mig-1g5gb-0", ("r",), "node-a", "GPU-0", 0, 19, 0, 1, 7, 0, "MIG-7", ("c/d",)
)
_PLAIN = ClaimRecord("u1", "ns", "c", ClaimState.PREPARE_COMPLETED, (_DEVICE,), True, 12.5)
_MPS = MpsDaemon("/p/mps/u1/pipe", "/p/mps/u1/log", ("MIG-7",), 4242)


def _data(raw: bytes) -> dict[str, object]:
    doc = json.loads(raw)
    assert isinstance(doc, dict)
    data = doc["data"]
    assert isinstance(data, dict)
    return data


def test_a_claim_with_mps_round_trips() -> None:
    cp = Checkpoint(claims={"u1": replace(_PLAIN, mps=_MPS)})
    assert decode(encode(cp)) == cp
    intent = Checkpoint(claims={"u1": replace(_PLAIN, mps=replace(_MPS, pid=None))})
    assert decode(encode(intent)) == intent


def test_a_daemon_in_a_pod_is_recorded_by_its_pod_and_only_then_has_the_key() -> None:
    in_pod = replace(_MPS, pid=None, pod="carve-system/carve-mps-u1")
    cp = Checkpoint(claims={"u1": replace(_PLAIN, mps=in_pod)})
    assert decode(encode(cp)) == cp
    claims = _data(encode(cp))["claims"]
    assert isinstance(claims, dict)
    assert claims["u1"]["mps"]["pod"] == "carve-system/carve-mps-u1"
    # A child process's record is byte for byte what was written before the key existed.
    child = encode(Checkpoint(claims={"u1": replace(_PLAIN, mps=_MPS)}))
    assert b'"pod"' not in child
    assert decode(child).claims["u1"].mps == _MPS


def test_without_mps_the_file_has_no_mps_key_and_old_files_load() -> None:
    raw = encode(Checkpoint(claims={"u1": _PLAIN}))
    assert b'"mps"' not in raw  # byte for byte what carve 0.1.0 wrote for it
    assert decode(raw).claims["u1"].mps is None


def test_what_0_1_0_reads_is_unchanged_by_the_mps_key() -> None:
    """carve 0.1.0 reads claim keys by name and ignores others, and its checksum covers all of
    `data`: the file with MPS is valid for it and says the same about everything it knows."""
    with_mps = _data(encode(Checkpoint(claims={"u1": replace(_PLAIN, mps=_MPS)})))
    without = _data(encode(Checkpoint(claims={"u1": _PLAIN})))
    claims = with_mps["claims"]
    assert isinstance(claims, dict)
    assert claims["u1"].pop("mps") == {
        "pipeDir": "/p/mps/u1/pipe",
        "logDir": "/p/mps/u1/log",
        "visibleDevices": ["MIG-7"],
        "pid": 4242,
    }
    assert with_mps == without
    doc = json.loads(encode(Checkpoint(claims={"u1": replace(_PLAIN, mps=_MPS)})))
    assert doc["checksum"] == v1.checksum(doc["data"])


@pytest.mark.parametrize(
    ("mps", "message"),
    [
        ("yes", "data.claims['u1'].mps: expected an object"),
        ({"logDir": "/l", "visibleDevices": []}, "data.claims['u1'].mps: 'pipeDir' is missing"),
        (
            {"pipeDir": "/p", "logDir": "/l", "pid": "12"},
            "data.claims['u1'].mps.pid: expected an integer or null",
        ),
        (
            {"pipeDir": "/p", "logDir": "/l", "pid": None, "pod": 7},
            "data.claims['u1'].mps.pod: expected a string or null",
        ),
    ],
)
def test_a_malformed_mps_record_is_damage_named_by_its_place(mps: object, message: str) -> None:
    data = _data(encode(Checkpoint(claims={"u1": _PLAIN})))
    claims = data["claims"]
    assert isinstance(claims, dict)
    claims["u1"]["mps"] = mps
    raw = json.dumps({"version": 1, "checksum": v1.checksum(data), "data": data}).encode()
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode(raw)
