"""Which format versions this build reads and which one it writes; picks the codec for a file.

Introducing a version is adding a codec module (`v2.py`) and listing it in `FORMATS`; moving
what is written to it is a separate, later change, made only once the release before it reads
it (`PREVIOUS_RELEASE_READS`). The rules are in the package docstring and docs/checkpoint.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from kubeletplugin.checkpoint import v1
from kubeletplugin.checkpoint.codec import CheckpointError, CheckpointVersionError, Codec
from kubeletplugin.checkpoint.model import Checkpoint


class Formats:
    """A set of codecs and the version written with them: the whole policy of one build."""

    def __init__(self, codecs: Iterable[Codec], *, writes: int) -> None:
        by_version: dict[int, Codec] = {}
        for c in codecs:
            if c.version in by_version:
                raise ValueError(f"two codecs for checkpoint version {c.version}")
            by_version[c.version] = c
        if writes not in by_version:
            raise ValueError(f"checkpoint version {writes} is written but has no codec")
        self._codecs: Mapping[int, Codec] = by_version
        self.writes = writes

    @property
    def reads(self) -> tuple[int, ...]:
        return tuple(sorted(self._codecs))

    def encode(self, cp: Checkpoint) -> bytes:
        return self._codecs[self.writes].encode(cp)

    def decode(self, raw: bytes, *, path: Path | None = None) -> Checkpoint:
        """The checkpoint in `raw`.

        Raises CheckpointError for a damaged file and CheckpointVersionError (naming `path`)
        for an intact one in a version this build does not read. The version is looked at
        before anything else the version defines, the checksum included: a future version
        may checksum differently, and its file must not be mistaken for a damaged one.
        """
        doc = _top_level(raw)
        version = _version_of(doc)
        codec = self._codecs.get(version)
        if codec is None:
            raise CheckpointVersionError(version, self.reads, self.writes, path)
        return codec.decode(doc)


def _top_level(raw: bytes) -> dict[str, object]:
    try:
        doc = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"the top level is a JSON {type(doc).__name__}, not an object")
    return doc


def _version_of(doc: Mapping[str, object]) -> int:
    """The format version; every release has written a positive integer, so anything else is
    damage rather than a version from elsewhere."""
    if "version" not in doc:
        raise CheckpointError('no "version" field at the top level')
    version = doc["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f'"version" is {version!r}, not a positive integer')
    return version


FORMATS = Formats([v1.CODEC], writes=v1.VERSION)

# The versions the latest published release (carve 0.1.0) reads. What this build writes must be
# among them, so that rolling a node back to that release keeps its claims. Update this when a
# release is cut, to the versions that release reads.
PREVIOUS_RELEASE_READS: frozenset[int] = frozenset({1})

READ_VERSIONS = FORMATS.reads
WRITTEN_VERSION = FORMATS.writes


def encode(cp: Checkpoint) -> bytes:
    """`cp` as the file this build writes (version WRITTEN_VERSION)."""
    return FORMATS.encode(cp)


def decode(raw: bytes, *, path: Path | None = None) -> Checkpoint:
    """`raw` read with this build's codecs; see Formats.decode for the two errors."""
    return FORMATS.decode(raw, path=path)
