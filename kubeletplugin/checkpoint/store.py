"""The checkpoint file on disk: atomic saves, and what a bad file does at start-up."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from driver.cdi import atomic_write
from kubeletplugin.checkpoint.codec import CheckpointError
from kubeletplugin.checkpoint.model import Checkpoint
from kubeletplugin.checkpoint.versions import FORMATS, Formats

log = logging.getLogger("kubeletplugin.checkpoint")

FILE_NAME = "checkpoint.json"


@dataclass
class CheckpointStore:
    """Loads and atomically saves the checkpoint file in `directory`."""

    directory: Path
    recovered_from: Path | None = None  # where a corrupt file was moved, if any
    # The boot ID a corrupt file still shows (data.bootID, read without trusting anything
    # else in it), if any: enough to tell that it was written before a reboot.
    damaged_boot_id: str | None = None
    formats: Formats = field(default=FORMATS, repr=False)

    @property
    def path(self) -> Path:
        return self.directory / FILE_NAME

    def load(self) -> Checkpoint:
        """The saved checkpoint; an empty one if there is none or it is corrupt (moved aside).

        A file in a version this build does not read raises CheckpointVersionError and is
        left exactly where it is: it is not damaged, and whichever release can read it needs
        to find it there.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return Checkpoint()
        try:
            return self.formats.decode(raw, path=self.path)
        except CheckpointError as e:
            aside = self.path.with_name(f"{FILE_NAME}.corrupt-{int(time.time() * 1000)}")
            os.replace(self.path, aside)
            self.recovered_from = aside
            self.damaged_boot_id = _salvage_boot_id(raw)
            log.error(
                "checkpoint corrupt, starting empty and reconciling from NVML",
                extra={"checkpoint": str(self.path), "movedTo": str(aside), "reason": str(e)},
            )
            return Checkpoint()

    def save(self, cp: Checkpoint) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, self.formats.encode(cp), mode=0o600)


def _salvage_boot_id(raw: bytes) -> str | None:
    """`data.bootID` of a damaged file if it is still there as a string, else None. Only ever
    used to refuse rebuilding claims from instances (a wrong value can make the rebuild release
    claims it could have kept, never adopt an instance it should not)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    boot = data.get("bootID") if isinstance(data, dict) else None
    return boot if isinstance(boot, str) and boot else None
