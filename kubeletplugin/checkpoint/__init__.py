"""The node agent's durable memory: which claim owns which MIG instance.

The checkpoint is what makes prepare and unprepare crash safe (DESIGN invariants 2 and 3). Each
claim moves through explicit states, and every transition is written to disk *before* the NVML
work it announces:

    (absent) -> PREPARE_STARTED -> PREPARE_COMPLETED -> UNPREPARE_STARTED -> (absent)

PREPARE_STARTED carries the intended GPU, profile and placement of every device, so a restart can
find and roll back an instance that was created but never recorded. PREPARE_COMPLETED adds the
GPU-instance and compute-instance IDs, MIG UUIDs and CDI IDs. A claim with MPS sharing also
records its MPS control daemon (directories first, then its pid once it answers).

The file and every claim record carry the node's boot ID (kubeletplugin.ledger): no MIG
instance outlives a reboot, so a record of an earlier boot owns no live instance, whatever sits
at its placement now.

Layout of the package: `model` holds the types the plugin works with (frozen dataclasses, no
notion of files); each on-disk format version is one codec module (`v1`); `versions` lists the
versions this build reads and the one it writes; `store` reads and atomically replaces the file.

Compatibility rules (docs/checkpoint.md tells the story for operators):

- Every version is a JSON object with an integer `"version"` at the top; the rest is the
  version's own business (v1: a SHA-256 checksum over `data`).
- This build reads versions READ_VERSIONS (today 1) and writes WRITTEN_VERSION (today 1).
- What a build writes must be readable by the previous release (PREVIOUS_RELEASE_READS), so
  that a node rolled back keeps its prepared claims. Hence a new version arrives in two steps:
  release N adds the codec `vK.py` and lists it in `versions.FORMATS` but keeps writing the old
  version; release N+1 (whose predecessor N now reads K) switches `writes` to K. Reading an
  old version is dropped only once no release a node may be upgraded from still writes it.
- A file in a version this build does not read (newer, or dropped) raises
  CheckpointVersionError: the plugin refuses to start and the file is left untouched, since
  treating it as empty would forget every prepared claim on the node.
- A damaged file (not JSON, no version, failed checksum, malformed record) raises
  CheckpointError: the store moves it aside (never deletes it: an operator may need it), logs
  what is wrong, and the agent starts empty and reconciles from NVML.
"""

from __future__ import annotations

from kubeletplugin.checkpoint.codec import CheckpointError, CheckpointVersionError, Codec
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
from kubeletplugin.checkpoint.store import FILE_NAME, CheckpointStore
from kubeletplugin.checkpoint.versions import (
    FORMATS,
    PREVIOUS_RELEASE_READS,
    READ_VERSIONS,
    WRITTEN_VERSION,
    Formats,
    decode,
    encode,
)

__all__ = [
    "FILE_NAME",
    "FORMATS",
    "PREVIOUS_RELEASE_READS",
    "READ_VERSIONS",
    "WRITTEN_VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointVersionError",
    "ClaimRecord",
    "ClaimState",
    "Codec",
    "DeviceRecord",
    "ForeignInstance",
    "Formats",
    "MpsDaemon",
    "WarmInstance",
    "WarmState",
    "decode",
    "encode",
]
