"""One node agent per node: the checkpoint directory is locked for the whole life of the process.

Two agents on one checkpoint would each load it, carve and destroy MIG instances behind the
other's back, and overwrite each other's saves: records lost, instances leaked or destroyed under
a running pod (DESIGN invariants 2 and 3). That happens in life: a DaemonSet rolled out with
`maxSurge` starts the new pod while the old one still runs, an operator starts the binary by hand
on a node that runs the DaemonSet, two charts install the driver twice.

The lock is `flock(LOCK_EX)` on `<checkpoint-dir>/agent.lock`, taken before the checkpoint (or
anything else in the directory) is read (NVML is open by then, which changes nothing) and held
until the process exits: the kernel drops it when the process dies however it dies (SIGKILL,
OOM), so there is no stale lock to clean up.
The file holds the holder's pid, host name and start time, for the message only: the lock is the
flock, never the file's content.

A second agent **waits**, rather than exiting: a rolling update with surge, or a restart whose
predecessor is still shutting down (the plugin finishes in-flight prepares before it exits),
ends with the first agent gone, and the waiting one then takes over at once, without a crash
loop and its back-off. While it waits it serves nothing (no socket, no ResourceSlices: the
kubelet keeps talking to the first), it says why once in the log and in a Node event
(`AgentWaitingForLock`), and repeats the log line every `_REMIND_SECONDS`. SIGTERM ends the wait.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kubeletplugin.nodeevents import NodeEvents

log = logging.getLogger(__name__)

LOCK_FILE = "agent.lock"
_REMIND_SECONDS = 60.0


class LockWaitStoppedError(Exception):
    """Asked to stop while waiting for the lock: the agent exits without having served."""


@dataclass(frozen=True)
class HolderInfo:
    """What the lock file says about the agent that holds it (for messages only)."""

    pid: int | None
    host: str
    since: str

    def __str__(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "an unknown pid"
        host = f" on host {self.host}" if self.host else ""
        since = f", since {self.since}" if self.since else ""
        return f"{pid}{host}{since}"


class AgentLock:
    """The lock on one checkpoint directory; `try_acquire` once, then held until `release`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        # A file object rather than a bare descriptor: should the lock's owner be dropped
        # without `release` (an agent object built in a test and never run), closing it on
        # garbage collection drops the flock, instead of a descriptor leaked for good.
        self._file: BinaryIO | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def try_acquire(self) -> bool:
        """Take the lock if no other process (or other AgentLock) holds it."""
        if self._file is not None:
            return True
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        f = os.fdopen(fd, "r+b", buffering=0)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        f.truncate(0)
        f.write(f"pid={os.getpid()}\nhost={socket.gethostname()}\nsince={now}\n".encode())
        self._file = f
        return True

    def holder(self) -> HolderInfo:
        """Who holds it, as its file says (best effort: it may be rewritten meanwhile)."""
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            text = ""
        fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        pid = fields.get("pid", "")
        return HolderInfo(
            int(pid) if pid.isdigit() else None, fields.get("host", ""), fields.get("since", "")
        )

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the only descriptor drops the flock
            self._file = None


def hold_checkpoint_dir(
    directory: Path,
    *,
    stop: threading.Event,
    events: NodeEvents | None = None,
    poll_seconds: float = 0.5,
) -> AgentLock:
    """The checkpoint directory's lock, waiting while another agent holds it.

    Raises LockWaitStoppedError when `stop` is set first. The wait polls (flock has no timeout, and
    a blocking flock would not let SIGTERM end the wait)."""
    lock = AgentLock(directory)
    if lock.try_acquire():
        return lock
    holder = lock.holder()
    why = (
        f"another carve-kubelet-plugin ({holder}) holds the lock on checkpoint directory "
        f"{directory} ({lock.path}); two agents on one node would carve and destroy each "
        "other's MIG instances and overwrite each other's checkpoint"
    )
    todo = (
        "this one waits, serving nothing, and takes over when that one exits (as in a rolling "
        "update). If that one should not run, stop it: find it with "
        f"`fuser -v {lock.path}`; a stray second DaemonSet or a copy started by hand are the "
        "usual causes"
    )
    log.warning(
        "waiting for the checkpoint directory: another agent runs on this node",
        extra={"lock": str(lock.path), "holder": str(holder), "reason": why, "todo": todo},
    )
    if events is not None:
        events.event(
            type_="Warning",
            reason="AgentWaitingForLock",
            message=f"carve-kubelet-plugin pid {os.getpid()} on {socket.gethostname()} is "
            f"waiting: {why}; {todo}",
            action="Start",
        )
    waited = 0.0
    while not stop.wait(poll_seconds):
        waited += poll_seconds
        if lock.try_acquire():
            log.info(
                "checkpoint directory lock taken: the other agent is gone",
                extra={"lock": str(lock.path), "waitedSeconds": round(waited, 1)},
            )
            return lock
        if waited % _REMIND_SECONDS < poll_seconds:
            log.warning(
                "still waiting for the checkpoint directory lock",
                extra={"lock": str(lock.path), "holder": str(lock.holder())},
            )
    raise LockWaitStoppedError(f"stopped while waiting for {lock.path} ({why})")
