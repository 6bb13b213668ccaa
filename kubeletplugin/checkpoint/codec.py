"""The contract every on-disk format version implements, and the two ways reading can fail.

A codec turns the internal `Checkpoint` into the bytes of one format version and back. The only
thing all versions share is the outer shape that lets any release tell them apart: a JSON object
with an integer `"version"` at the top. Everything else (checksum, field names, layout) belongs
to the version, so a new version is free to change it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubeletplugin.checkpoint.model import Checkpoint


class CheckpointError(ValueError):
    """The checkpoint file is damaged: not JSON, a failed checksum, or a malformed record.

    The store moves such a file aside and starts empty; the message says what is wrong and
    where, so the operator reading the log can tell a torn write from a hand edit.
    """


class CheckpointVersionError(Exception):
    """The file is in a format version this build does not read.

    Deliberately not a `CheckpointError`: a damaged file is moved aside and the agent starts
    empty, but a file that another release wrote in good order would then be silently
    forgotten: every claim prepared on the node lost, its MIG instances treated as foreign,
    its CDI specs removed as orphans. The plugin refuses to start instead, and the message
    names the file, the version found, the versions this build reads, and the ways out.
    """

    def __init__(
        self, found: int, reads: Sequence[int], writes: int, path: Path | None = None
    ) -> None:
        self.found = found
        self.reads = tuple(sorted(reads))
        self.writes = writes
        self.path = path
        super().__init__(self._message())

    def at(self, path: Path) -> CheckpointVersionError:
        """The same refusal, naming the file it came from."""
        return CheckpointVersionError(self.found, self.reads, self.writes, path)

    def _message(self) -> str:
        where = str(self.path) if self.path is not None else "the checkpoint file"
        reads = ", ".join(str(v) for v in self.reads)
        if self.found > max(self.reads):
            origin = "a newer carve-kubelet-plugin wrote it"
            run_other = (
                f"run a carve-kubelet-plugin release that reads version {self.found} "
                "(finish the upgrade, or undo this downgrade)"
            )
        else:
            origin = "an older carve-kubelet-plugin wrote it, in a format this release dropped"
            run_other = (
                f"start once a release that reads both version {self.found} and version "
                f"{self.writes}, so that it rewrites the file, then this release"
            )
        return (
            f"checkpoint {where} has format version {self.found}, but this "
            f"carve-kubelet-plugin reads only version(s) {reads} (and writes version "
            f"{self.writes}): {origin}. Refusing to start, because starting empty would forget "
            "every claim prepared on this node (their MIG instances would be treated as foreign "
            "and their CDI specs removed). To fix: "
            f"{run_other}; or put back the checkpoint file this release wrote before; or, "
            f"accepting that carve forgets those claims (their instances stay as foreign "
            "instances, and their node finalizers and running pods need handling by hand), "
            f"move {where} away and restart. See docs/checkpoint.md."
        )


@dataclass(frozen=True)
class Codec:
    """One on-disk format version.

    `decode` receives the parsed top-level object (its `"version"` already checked to be
    `version`) and raises `CheckpointError` for anything it cannot trust; `encode` returns
    the complete file content.
    """

    version: int
    encode: Callable[[Checkpoint], bytes]
    decode: Callable[[Mapping[str, object]], Checkpoint]
