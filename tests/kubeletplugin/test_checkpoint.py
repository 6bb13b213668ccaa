from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeletplugin.checkpoint import (
    FILE_NAME,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    DeviceRecord,
    ForeignInstance,
    decode,
    encode,
)


def _record(uid: str = "u1", state: ClaimState = ClaimState.PREPARE_STARTED) -> ClaimRecord:
    dev = DeviceRecord(
        device_name="gpu-0-mig-1g10gb-19-3",
        request_names=("gpu",),
        pool_name="node-a",
        gpu_uuid="GPU-1",
        gpu_minor=0,
        profile_id=19,
        placement_start=3,
        placement_size=1,
    )
    return ClaimRecord(uid, "ns", "claim", state, (dev,))


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    rec = _record()
    done = ClaimRecord(
        rec.uid,
        rec.namespace,
        rec.name,
        ClaimState.PREPARE_COMPLETED,
        tuple(
            DeviceRecord(
                **{**d.__dict__, "gi_id": 9, "ci_id": 0, "mig_uuid": "MIG-x", "cdi_ids": ("k=v",)}
            )
            for d in rec.devices
        ),
        finalizer_added=True,
    )
    foreign = ForeignInstance("GPU-2", 5, 14, 4, 4, (0,), 1.0)
    cp = Checkpoint().with_claim(done).with_foreign((foreign,))
    store.save(cp)
    loaded = CheckpointStore(tmp_path).load()
    assert loaded == cp
    assert loaded.owner_of("GPU-1", 9) == cp.claims["u1"]
    assert loaded.owner_of("GPU-1", 8) is None


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path / "nope").load() == Checkpoint()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # torn write
        lambda raw: raw.replace(b"PrepareStarted", b"PrepareCompleted"),  # edited by hand
        lambda raw: b"\x00\xff garbage",
        lambda raw: raw.replace(b'"version": 1', b'"version": "1"'),  # a newer version is
        # not damage: it is refused, see test_checkpoint_versions.py
    ],
)
def test_corrupt_file_is_moved_aside_and_load_starts_empty(tmp_path: Path, damage: object) -> None:
    store = CheckpointStore(tmp_path)
    store.save(Checkpoint().with_claim(_record()))
    raw = store.path.read_bytes()
    store.path.write_bytes(damage(raw))  # type: ignore[operator]
    bad = store.path.read_bytes()
    assert store.load() == Checkpoint()
    assert store.recovered_from is not None
    assert store.recovered_from.read_bytes() == bad  # kept for the operator
    assert not store.path.exists()
    store.save(Checkpoint())  # and the agent can carry on
    assert store.load() == Checkpoint()


def test_checksum_detects_semantic_edit() -> None:
    raw = encode(Checkpoint().with_claim(_record()))
    doc = json.loads(raw)
    doc["data"]["claims"]["u1"]["devices"][0]["placementStart"] = 4
    with pytest.raises(CheckpointError, match="checksum"):
        decode(json.dumps(doc).encode())


def test_save_is_atomic_when_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)
    first = Checkpoint().with_claim(_record("a"))
    store.save(first)

    def crash(*_: object) -> None:
        raise KeyboardInterrupt  # as a signal would, mid-write

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.save(first.with_claim(_record("b")))
    monkeypatch.undo()
    assert store.load() == first
    assert sorted(os.listdir(tmp_path)) == [FILE_NAME]


def test_file_is_private(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(Checkpoint())
    assert (store.path.stat().st_mode & 0o777) == 0o600


@given(
    st.lists(
        st.tuples(
            st.text("abcdef0123456789-", min_size=1, max_size=12),
            st.sampled_from(list(ClaimState)),
        ),
        max_size=6,
    )
)
def test_encode_decode_inverse(items: list[tuple[str, ClaimState]]) -> None:
    cp = Checkpoint()
    for uid, state in items:
        cp = cp.with_claim(_record(uid, state))
    assert decode(encode(cp)) == cp
