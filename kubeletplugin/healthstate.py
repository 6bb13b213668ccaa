"""The GPU health conditions on disk, so a restarted plugin keeps tainting a GPU it found sick.

Without it a plugin restart forgets every condition that NVML cannot be asked for again: a
degraded GPU (its XID is an event, gone once read) would be published clean until its next
error, and a fatal XID whose recovery action the driver does not report would be forgotten.
A fatal condition that asked for a reset is kept too, so that a reset done while the plugin was
down is recognised by the first poll (the recovery action back to none).

The file is ``<plugins-dir>/<driver>/gpu-health.json``, written whole (new file, then rename)
whenever a condition changes. Format version 1::

    {"version": 1,
     "gpus": {"GPU-<uuid>": {"severity": "degraded" | "fatal", "value": "xid-92",
                              "reason": "XID 92 (...)", "since": <unix seconds>,
                              "lastEvent": <unix seconds>, "eccUncorrected": 3 | null,
                              "recoveryAsked": true | false}},
     "instances": {"GPU-<uuid>/<GPU instance id>": {the same fields,
                                                    "profileId": 19, "start": 2}}}

``instances`` holds conditions of single MIG instances (driver.gpuhealth) with the place of
the instance's device, which tells a re-created instance of the same id from the old one; it
is optional (a file without it has none).

Compatibility: a reader ignores fields it does not know; a file of another version, or one
that cannot be read, is logged and left out (health is advisory and re-derived by the next
polls, unlike the claim checkpoint, so it never stops the plugin). Times are wall-clock seconds,
as the monitor's monotonic clock does not survive a restart; they are converted on both ways.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.gpuhealth import Condition, Severity
from driver.naming import DevicePlace

log = logging.getLogger(__name__)

VERSION = 1
FILE_NAME = "gpu-health.json"
_SEVERITIES = {"degraded": Severity.DEGRADED, "fatal": Severity.FATAL}


InstanceKey = tuple[str, int]  # (GPU UUID, GPU instance id)


@dataclass(frozen=True)
class SavedHealth:
    gpus: dict[str, Condition] = field(default_factory=dict)
    instances: dict[InstanceKey, Condition] = field(default_factory=dict)
    places: dict[InstanceKey, DevicePlace] = field(default_factory=dict)


def _entry(c: Condition, mono_now: float, wall_now: float) -> dict[str, Any]:
    names = {v: k for k, v in _SEVERITIES.items()}
    return {
        "severity": names[c.severity],
        "value": c.value,
        "reason": c.reason,
        "since": round(wall_now - (mono_now - c.since), 3),
        "lastEvent": round(wall_now - (mono_now - c.last_event), 3),
        "eccUncorrected": c.ecc_uncorrected,
        "recoveryAsked": c.recovery_asked,
    }


def encode(
    conditions: Mapping[str, Condition],
    *,
    mono_now: float,
    wall_now: float,
    instances: Mapping[InstanceKey, Condition] | None = None,
    places: Mapping[InstanceKey, DevicePlace] | None = None,
) -> str:
    """Conditions (times on the monotonic clock `mono_now` reads) as the file's text."""
    gpus = {
        gpu: _entry(c, mono_now, wall_now)
        for gpu, c in sorted(conditions.items())
        if c.severity in _SEVERITIES.values()
    }
    doc: dict[str, Any] = {"version": VERSION, "gpus": gpus}
    saved_instances = {}
    for (gpu, gi), c in sorted((instances or {}).items()):
        place = (places or {}).get((gpu, gi))
        if place is None or c.severity not in _SEVERITIES.values():
            continue  # without its place a restarted plugin cannot tell the instance again
        saved_instances[f"{gpu}/{gi}"] = {
            **_entry(c, mono_now, wall_now),
            "profileId": place[0],
            "start": place[1],
        }
    if saved_instances:
        doc["instances"] = saved_instances
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def _condition(raw: Any, mono_now: float, wall_now: float) -> Condition:
    ecc = raw.get("eccUncorrected")
    return Condition(
        severity=_SEVERITIES[raw["severity"]],
        value=str(raw["value"]),
        reason=str(raw["reason"]),
        since=mono_now - (wall_now - float(raw["since"])),
        last_event=mono_now - (wall_now - float(raw["lastEvent"])),
        ecc_uncorrected=None if ecc is None else int(ecc),
        recovery_asked=bool(raw.get("recoveryAsked", False)),
    )


class HealthStateError(ValueError):
    """The file cannot be used; the message says why."""


def decode(text: str, *, mono_now: float, wall_now: float) -> SavedHealth:
    """The file's conditions with times on the monotonic clock that reads `mono_now` now."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise HealthStateError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        got = doc.get("version") if isinstance(doc, dict) else None
        raise HealthStateError(f"format version {got!r}; this plugin reads version {VERSION}")
    gpus, instances = doc.get("gpus"), doc.get("instances", {})
    if not isinstance(gpus, dict) or not isinstance(instances, dict):
        raise HealthStateError("'gpus' and 'instances' must be objects")
    out = SavedHealth()
    for gpu, raw in gpus.items():
        try:
            out.gpus[str(gpu)] = _condition(raw, mono_now, wall_now)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise HealthStateError(f"GPU {gpu}: bad entry ({e!r})") from None
    for name, raw in instances.items():
        try:
            gpu, _, gi = str(name).rpartition("/")
            key = (gpu, int(gi))
            out.instances[key] = _condition(raw, mono_now, wall_now)
            out.places[key] = (int(raw["profileId"]), int(raw["start"]))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise HealthStateError(f"instance {name}: bad entry ({e!r})") from None
    return out


class HealthStateFile:
    """Loads and saves the conditions at `path` (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        mono_clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._mono = mono_clock
        self._wall = wall_clock

    def load(self) -> SavedHealth:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return SavedHealth()
        except OSError as e:
            log.warning(
                "cannot read the GPU health file", extra={"path": str(self.path), "error": str(e)}
            )
            return SavedHealth()
        try:
            return decode(text, mono_now=self._mono(), wall_now=self._wall())
        except HealthStateError as e:
            log.warning(
                "ignoring the GPU health file; health is re-derived from NVML",
                extra={"path": str(self.path), "error": str(e)},
            )
            return SavedHealth()

    def save(
        self,
        conditions: Mapping[str, Condition],
        instances: Mapping[InstanceKey, Condition] | None = None,
        places: Mapping[InstanceKey, DevicePlace] | None = None,
    ) -> None:
        text = encode(
            conditions,
            mono_now=self._mono(),
            wall_now=self._wall(),
            instances=instances,
            places=places,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
