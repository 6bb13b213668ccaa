"""A scripted ClaimPreparer and a running PluginServer for the gRPC-level tests.

The preparer is the only stand-in: sockets, gRPC, registration and the kubelet client are real.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kubeletplugin.ports import ClaimRef, PreparedDevice, PrepareResult
from kubeletplugin.server import PluginServer

DRIVER = "mig.carve.dev"


def device_for(claim: ClaimRef, share_id: str | None = None) -> PreparedDevice:
    """A deterministic device derived from the claim, so answers can be checked per claim."""
    return PreparedDevice(
        request_names=("gpu",),
        pool_name="node-a-gpu-0",
        device_name=f"gpu-0-mig-{claim.name}",
        cdi_device_ids=(f"{DRIVER}/mig={claim.uid}",),
        share_id=share_id,
    )


@dataclass
class FakePreparer:
    """Prepares every claim unless scripted otherwise; records what it was asked."""

    prepare_errors: dict[str, str] = field(default_factory=dict)  # uid -> error
    unprepare_errors: dict[str, str] = field(default_factory=dict)
    omit: set[str] = field(default_factory=set)  # uids left out of the answer
    share_ids: dict[str, str] = field(default_factory=dict)
    raise_on_prepare: Exception | None = None
    raise_on_unprepare: Exception | None = None
    prepare_calls: list[tuple[ClaimRef, ...]] = field(default_factory=list)
    unprepare_calls: list[tuple[ClaimRef, ...]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        with self._lock:
            self.prepare_calls.append(tuple(claims))
        if self.raise_on_prepare is not None:
            raise self.raise_on_prepare
        out: dict[str, PrepareResult] = {}
        for claim in claims:
            if claim.uid in self.omit:
                continue
            if claim.uid in self.prepare_errors:
                out[claim.uid] = PrepareResult(error=self.prepare_errors[claim.uid])
            else:
                share = self.share_ids.get(claim.uid)
                out[claim.uid] = PrepareResult(devices=(device_for(claim, share),))
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        with self._lock:
            self.unprepare_calls.append(tuple(claims))
        if self.raise_on_unprepare is not None:
            raise self.raise_on_unprepare
        return {
            c.uid: self.unprepare_errors.get(c.uid, "") for c in claims if c.uid not in self.omit
        }


@contextmanager
def short_tmpdir() -> Iterator[Path]:
    """Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="carve-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def running_plugin(
    root: Path,
    preparer: FakePreparer,
    health: list[tuple[str, str, bool, str]] | None = None,
    poll: float = 5.0,
    resend: float = 30.0,
) -> Iterator[PluginServer]:
    server = PluginServer(
        DRIVER,
        root / "plugins_registry",
        root / "plugins",
        preparer,
        (lambda: list(health)) if health is not None else None,
        health_poll_interval=poll,
        health_resend_interval=resend,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)
