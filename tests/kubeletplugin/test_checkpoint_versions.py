"""Checkpoint format versions: upgrade, downgrade, every codec's round trip, and refusal.

The v1 fixture below is the exact output of carve 0.1.0's writer (kubeletplugin/checkpoint.py
at commit 1acefa2, before versioned codecs) for `_RELEASE_0_1_0_CHECKPOINT`. It is committed
as bytes, not regenerated, so a change to what v1 writes or reads breaks these tests instead of
nodes that are upgraded or rolled back.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeletplugin.checkpoint import (
    FILE_NAME,
    FORMATS,
    PREVIOUS_RELEASE_READS,
    READ_VERSIONS,
    WRITTEN_VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CheckpointVersionError,
    ClaimRecord,
    ClaimState,
    Codec,
    DeviceRecord,
    ForeignInstance,
    Formats,
    MpsDaemon,
    WarmInstance,
    WarmState,
    decode,
    encode,
    v1,
)

# --- what carve 0.1.0 wrote -----------------------------------------------------------------

_RELEASE_0_1_0_CHECKPOINT = Checkpoint(
    claims={
        "u-whole": ClaimRecord(
            "u-whole",
            "team-b",
            "whole",
            ClaimState.PREPARE_COMPLETED,
            (
                DeviceRecord(
                    "gpu-1",
                    ("whole",),
                    "node-a",
                    "GPU-bbbb",
                    1,
                    cdi_ids=("mig.carve.dev/claim=u-whole-gpu-1",),
                ),
            ),
            finalizer_added=True,
            updated_at=1700000000.25,
        ),
        "u-start": ClaimRecord(
            "u-start",
            "default",
            "starting",
            ClaimState.PREPARE_STARTED,
            (
                DeviceRecord(
                    "gpu-0-mig-1g10gb-19-3", ("gpu", "extra"), "node-a", "GPU-aaaa", 0, 19, 3, 1
                ),
            ),
            finalizer_added=False,
            updated_at=1700000001.5,
        ),
        "u-done": ClaimRecord(
            "u-done",
            "default",
            "done",
            ClaimState.UNPREPARE_STARTED,
            (
                DeviceRecord(
                    "gpu-0-mig-3g40gb-9-4",
                    ("gpu",),
                    "node-a",
                    "GPU-aaaa",
                    0,
                    profile_id=9,
                    placement_start=4,
                    placement_size=4,
                    gi_id=2,
                    ci_id=0,
                    mig_uuid="MIG-1234",
                    cdi_ids=("mig.carve.dev/claim=u-done-gpu-0-mig-3g40gb-9-4",),
                    adopted=True,
                ),
            ),
            finalizer_added=True,
            updated_at=1700000002.125,
        ),
    },
    foreign=(
        ForeignInstance("GPU-aaaa", 7, 14, 0, 2, (0, 1), 1699999999.0),
        ForeignInstance("GPU-bbbb", 1, 0, 0, 8, (), 0.0),
    ),
)

_RELEASE_0_1_0_FILE = b"""{
 "checksum": "sha256:020e6b85a8695f1695d889013593f5c84fea40e1cf7cc01a7c621d3124e799bb",
 "data": {
  "claims": {
   "u-done": {
    "devices": [
     {
      "adopted": true,
      "cdiIDs": [
       "mig.carve.dev/claim=u-done-gpu-0-mig-3g40gb-9-4"
      ],
      "ciID": 0,
      "deviceName": "gpu-0-mig-3g40gb-9-4",
      "giID": 2,
      "gpuMinor": 0,
      "gpuUUID": "GPU-aaaa",
      "migUUID": "MIG-1234",
      "placementSize": 4,
      "placementStart": 4,
      "poolName": "node-a",
      "profileID": 9,
      "requestNames": [
       "gpu"
      ]
     }
    ],
    "finalizerAdded": true,
    "name": "done",
    "namespace": "default",
    "state": "UnprepareStarted",
    "uid": "u-done",
    "updatedAt": 1700000002.125
   },
   "u-start": {
    "devices": [
     {
      "adopted": false,
      "cdiIDs": [],
      "ciID": null,
      "deviceName": "gpu-0-mig-1g10gb-19-3",
      "giID": null,
      "gpuMinor": 0,
      "gpuUUID": "GPU-aaaa",
      "migUUID": null,
      "placementSize": 1,
      "placementStart": 3,
      "poolName": "node-a",
      "profileID": 19,
      "requestNames": [
       "gpu",
       "extra"
      ]
     }
    ],
    "finalizerAdded": false,
    "name": "starting",
    "namespace": "default",
    "state": "PrepareStarted",
    "uid": "u-start",
    "updatedAt": 1700000001.5
   },
   "u-whole": {
    "devices": [
     {
      "adopted": false,
      "cdiIDs": [
       "mig.carve.dev/claim=u-whole-gpu-1"
      ],
      "ciID": null,
      "deviceName": "gpu-1",
      "giID": null,
      "gpuMinor": 1,
      "gpuUUID": "GPU-bbbb",
      "migUUID": null,
      "placementSize": null,
      "placementStart": null,
      "poolName": "node-a",
      "profileID": null,
      "requestNames": [
       "whole"
      ]
     }
    ],
    "finalizerAdded": true,
    "name": "whole",
    "namespace": "team-b",
    "state": "PrepareCompleted",
    "uid": "u-whole",
    "updatedAt": 1700000000.25
   }
  },
  "foreign": [
   {
    "ciIDs": [
     0,
     1
    ],
    "firstSeen": 1699999999.0,
    "giID": 7,
    "gpuUUID": "GPU-aaaa",
    "placementSize": 2,
    "placementStart": 0,
    "profileID": 14
   },
   {
    "ciIDs": [],
    "firstSeen": 0.0,
    "giID": 1,
    "gpuUUID": "GPU-bbbb",
    "placementSize": 8,
    "placementStart": 0,
    "profileID": 0
   }
  ]
 },
 "version": 1
}
"""

_RELEASE_0_1_0_EMPTY_FILE = b"""{
 "checksum": "sha256:f5a4c62854f2bd1fc48e501573e118e4eef26d31719639d101326f7379de93ca",
 "data": {
  "claims": {},
  "foreign": []
 },
 "version": 1
}
"""


def _v1_file(data: Mapping[str, Any], version: object = 1) -> bytes:
    """A v1-shaped file around `data` with a valid checksum, computed here rather than by the
    code under test, as carve 0.1.0 computes it."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    doc = {"version": version, "checksum": "sha256:" + hashlib.sha256(canonical).hexdigest()}
    return json.dumps({**doc, "data": data}).encode()


# --- upgrade: files written before versioned codecs -----------------------------------------


def test_upgrade_reads_the_file_carve_0_1_0_wrote() -> None:
    assert decode(_RELEASE_0_1_0_FILE) == _RELEASE_0_1_0_CHECKPOINT
    assert decode(_RELEASE_0_1_0_EMPTY_FILE) == Checkpoint()


def test_upgrade_through_the_store_keeps_the_file_in_place(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_bytes(_RELEASE_0_1_0_FILE)
    store = CheckpointStore(tmp_path)
    assert store.load() == _RELEASE_0_1_0_CHECKPOINT
    assert store.recovered_from is None
    assert (tmp_path / FILE_NAME).read_bytes() == _RELEASE_0_1_0_FILE


def test_v1_reader_still_fills_in_keys_a_hand_made_file_may_lack() -> None:
    """carve 0.1.0 read these keys as optional; a file that relies on that must keep loading."""
    raw = _v1_file(
        {
            "claims": {
                "u1": {
                    "uid": "u1",
                    "namespace": "ns",
                    "name": "c",
                    "state": "PrepareStarted",
                    "devices": [
                        {"deviceName": "gpu-0", "poolName": "n", "gpuUUID": "G", "gpuMinor": 0}
                    ],
                }
            },
        }
    )
    (rec,) = decode(raw).claims.values()
    assert rec == ClaimRecord(
        "u1", "ns", "c", ClaimState.PREPARE_STARTED, (DeviceRecord("gpu-0", (), "n", "G", 0),)
    )
    assert decode(raw).foreign == ()


# --- downgrade: carve 0.1.0 must read what this build writes --------------------------------


def test_downgrade_this_build_writes_exactly_the_bytes_carve_0_1_0_wrote() -> None:
    assert encode(_RELEASE_0_1_0_CHECKPOINT) == _RELEASE_0_1_0_FILE
    assert encode(Checkpoint()) == _RELEASE_0_1_0_EMPTY_FILE


def test_written_version_is_one_the_previous_release_reads() -> None:
    assert WRITTEN_VERSION in PREVIOUS_RELEASE_READS
    assert WRITTEN_VERSION in READ_VERSIONS


# --- round trips over generated checkpoints -------------------------------------------------

_text = st.text(max_size=12)
_ints = st.integers()
_maybe_int = st.none() | _ints
_seconds = st.floats(allow_nan=False, allow_infinity=False)

_devices = st.builds(
    DeviceRecord,
    device_name=_text,
    request_names=st.lists(_text, max_size=3).map(tuple),
    pool_name=_text,
    gpu_uuid=_text,
    gpu_minor=_ints,
    profile_id=_maybe_int,
    placement_start=_maybe_int,
    placement_size=_maybe_int,
    gi_id=_maybe_int,
    ci_id=_maybe_int,
    mig_uuid=st.none() | _text,
    cdi_ids=st.lists(_text, max_size=3).map(tuple),
    adopted=st.booleans(),
    restore_mig=st.booleans(),
)
_mps = st.builds(
    MpsDaemon,
    pipe_dir=_text,
    log_dir=_text,
    visible_devices=st.lists(_text, max_size=3).map(tuple),
    pid=_maybe_int,
    pod=st.none() | _text,
)
_claims = st.builds(
    ClaimRecord,
    uid=_text,
    namespace=_text,
    name=_text,
    state=st.sampled_from(list(ClaimState)),
    devices=st.lists(_devices, max_size=3).map(tuple),
    finalizer_added=st.booleans(),
    updated_at=_seconds,
    mps=st.none() | _mps,
    boot_id=st.none() | _text,
)
_foreign = st.builds(
    ForeignInstance,
    gpu_uuid=_text,
    gi_id=_ints,
    profile_id=_ints,
    placement_start=_ints,
    placement_size=_ints,
    ci_ids=st.lists(_ints, max_size=3).map(tuple),
    first_seen=_seconds,
)
_warm = st.builds(
    WarmInstance,
    gpu_uuid=_text,
    gpu_minor=_ints,
    gi_id=_ints,
    ci_id=_ints,
    mig_uuid=_text,
    profile_id=_ints,
    placement_start=_ints,
    placement_size=_ints,
    namespace=_text,
    since=_seconds,
    state=st.sampled_from(list(WarmState)),
)
_checkpoints = st.builds(
    Checkpoint,
    claims=st.lists(_claims, max_size=4).map(lambda rs: {r.uid: r for r in rs}),
    foreign=st.lists(_foreign, max_size=3).map(tuple),
    warm=st.lists(_warm, max_size=3).map(tuple),
    boot_id=st.none() | _text,
)

# Every codec this build has, so a new version is covered by adding it to FORMATS.
_CODECS = [v1.CODEC]


def test_every_codec_of_this_build_is_round_tripped_here() -> None:
    assert sorted(c.version for c in _CODECS) == list(READ_VERSIONS)


@pytest.mark.parametrize("codec", _CODECS, ids=lambda c: f"v{c.version}")
@given(cp=_checkpoints)
def test_every_codec_round_trips_every_checkpoint(codec: Codec, cp: Checkpoint) -> None:
    raw = codec.encode(cp)
    doc = json.loads(raw)
    assert doc["version"] == codec.version
    assert codec.decode(doc) == cp


@given(cp=_checkpoints)
def test_what_this_build_writes_it_reads_back(cp: Checkpoint) -> None:
    assert decode(encode(cp)) == cp


@given(cp=_checkpoints)
def test_downgrade_what_this_build_writes_parses_with_the_v1_codec(cp: Checkpoint) -> None:
    doc = json.loads(encode(cp))
    assert doc["version"] == 1
    assert v1.decode(doc) == cp


# --- the mechanism: a second version is one codec added -------------------------------------


def _v2_encode(cp: Checkpoint) -> bytes:
    """A stand-in future format: a different layout (v1 nested, no checksum of its own)."""
    return json.dumps({"version": 2, "wrapped": json.loads(v1.encode(cp))}).encode()


def _v2_decode(doc: Mapping[str, object]) -> Checkpoint:
    wrapped = doc.get("wrapped")
    if not isinstance(wrapped, dict):
        raise CheckpointError("wrapped is not an object")
    return v1.decode(wrapped)


_V2 = Codec(2, _v2_encode, _v2_decode)


def test_a_build_that_adds_a_codec_reads_both_versions_and_keeps_writing_the_old_one() -> None:
    nxt = Formats([v1.CODEC, _V2], writes=1)
    assert nxt.reads == (1, 2)
    assert nxt.decode(_RELEASE_0_1_0_FILE) == _RELEASE_0_1_0_CHECKPOINT
    assert nxt.decode(_v2_encode(_RELEASE_0_1_0_CHECKPOINT)) == _RELEASE_0_1_0_CHECKPOINT
    assert nxt.encode(_RELEASE_0_1_0_CHECKPOINT) == _RELEASE_0_1_0_FILE


def test_a_build_that_writes_the_new_version_is_readable_by_the_one_that_added_it() -> None:
    adds = Formats([v1.CODEC, _V2], writes=1)
    switches = Formats([v1.CODEC, _V2], writes=2)
    raw = switches.encode(_RELEASE_0_1_0_CHECKPOINT)
    assert json.loads(raw)["version"] == 2
    assert adds.decode(raw) == _RELEASE_0_1_0_CHECKPOINT
    # ...while skipping the step (rolling back to this build) is refused, not misread
    with pytest.raises(CheckpointVersionError) as refused:
        FORMATS.decode(raw)
    assert (refused.value.found, refused.value.reads) == (2, (1,))


def test_a_build_that_dropped_a_version_refuses_it_and_says_how_to_migrate() -> None:
    only_v2 = Formats([_V2], writes=2)
    with pytest.raises(CheckpointVersionError, match="dropped") as refused:
        only_v2.decode(_RELEASE_0_1_0_FILE, path=Path("/x/checkpoint.json"))
    assert "reads both version 1 and version 2" in str(refused.value)


@pytest.mark.parametrize(
    ("codecs", "writes", "message"),
    [([v1.CODEC], 2, "no codec"), ([v1.CODEC, v1.CODEC], 1, "two codecs")],
)
def test_formats_reject_an_inconsistent_policy(
    codecs: list[Codec], writes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Formats(codecs, writes=writes)


# --- a version this build does not read ------------------------------------------------------


def _future_file() -> bytes:
    """What a newer carve might write: a version past ours, with fields we cannot verify."""
    return json.dumps(
        {"version": max(READ_VERSIONS) + 1, "checksum": "blake3:00", "x": {}}
    ).encode()


def test_unknown_version_is_refused_with_a_message_that_says_what_to_do() -> None:
    path = Path("/var/lib/kubelet/plugins/mig.carve.dev/checkpoint.json")
    with pytest.raises(CheckpointVersionError) as refused:
        decode(_future_file(), path=path)
    err = refused.value
    assert (err.found, err.reads, err.writes, err.path) == (2, (1,), 1, path)
    msg = str(err)
    assert f"checkpoint {path} has format version 2" in msg
    assert "reads only version(s) 1" in msg
    assert "a newer carve-kubelet-plugin wrote it" in msg
    assert "Refusing to start" in msg
    assert "run a carve-kubelet-plugin release that reads version 2" in msg  # upgrade
    assert "put back the checkpoint file this release wrote before" in msg  # restore
    assert f"move {path} away" in msg and "forgets those claims" in msg  # remove, and its cost
    assert not isinstance(err, CheckpointError)  # so nothing treats it as a damaged file


def test_store_refuses_an_unknown_version_and_leaves_the_file_alone(tmp_path: Path) -> None:
    raw = _future_file()
    (tmp_path / FILE_NAME).write_bytes(raw)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointVersionError, match=str(tmp_path / FILE_NAME)):
        store.load()
    assert store.recovered_from is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]
    assert (tmp_path / FILE_NAME).read_bytes() == raw


# --- damaged files keep being moved aside, with a specific reason ----------------------------

_GOOD_DEVICE = {"deviceName": "gpu-0", "poolName": "n", "gpuUUID": "G", "gpuMinor": 0}
_GOOD_CLAIM = {"uid": "u1", "namespace": "ns", "name": "c", "state": "PrepareCompleted"}
_GOOD_FOREIGN = {"gpuUUID": "G", "giID": 1, "profileID": 0, "placementStart": 0, "placementSize": 8}


def _claim_file(**changes: object) -> bytes:
    return _v1_file({"claims": {"u1": {**_GOOD_CLAIM, "devices": [_GOOD_DEVICE], **changes}}})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"\x00\xff garbage", "not valid JSON"),
        (b"[1]", "the top level is a JSON list, not an object"),
        (b'{"checksum": "", "data": {}}', 'no "version" field'),
        (_v1_file({}, version="1"), "\"version\" is '1', not a positive integer"),
        (_v1_file({}, version=0), '"version" is 0, not a positive integer'),
        (_v1_file({}, version=True), '"version" is True, not a positive integer'),
        (_v1_file({}, version=1.0), '"version" is 1.0, not a positive integer'),
        (_RELEASE_0_1_0_FILE.replace(b'"giID": 7', b'"giID": 8'), "checksum mismatch"),
        (b'{"version": 1, "data": []}', '"data" is list, not an object'),
        (
            _claim_file(state="Prepared"),
            "data.claims['u1'].state: 'Prepared' is not one of PrepareCompleted",
        ),
        (
            _v1_file({"claims": {"u1": {k: v for k, v in _GOOD_CLAIM.items() if k != "uid"}}}),
            "data.claims['u1']: 'uid' is missing",
        ),
        (
            _claim_file(devices=[{**_GOOD_DEVICE, "gpuMinor": "0"}]),
            "data.claims['u1'].devices[0].gpuMinor: expected an integer, got '0'",
        ),
        (
            _claim_file(devices=[{**_GOOD_DEVICE, "requestNames": "gpu"}]),
            "data.claims['u1'].devices[0].requestNames: expected a list, got 'gpu'",
        ),
        (
            _claim_file(finalizerAdded=1),
            "data.claims['u1'].finalizerAdded: expected true or false, got 1",
        ),
        (
            _v1_file({"foreign": [{**_GOOD_FOREIGN, "ciIDs": [0, None]}]}),
            "data.foreign[0].ciIDs: expected a list of integers, got [0, None]",
        ),
        (_v1_file({"foreign": [7]}), "data.foreign[0]: expected an object, got int"),
    ],
)
def test_damaged_file_is_moved_aside_with_a_reason_that_says_what_is_wrong(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, raw: bytes, reason: str
) -> None:
    with pytest.raises(CheckpointError) as damaged:
        decode(raw)
    assert reason in str(damaged.value)

    (tmp_path / FILE_NAME).write_bytes(raw)
    store = CheckpointStore(tmp_path)
    with caplog.at_level(logging.ERROR, logger="kubeletplugin.checkpoint"):
        assert store.load() == Checkpoint()
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == raw
    (logged,) = [r for r in caplog.records if r.getMessage().startswith("checkpoint corrupt")]
    assert reason in logged.__dict__["reason"]
    assert logged.__dict__["checkpoint"] == str(tmp_path / FILE_NAME)
