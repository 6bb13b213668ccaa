"""Child processes that cannot outlive their owner.

Three layers make sure a failed or killed test run leaves nothing behind:
1. each component runs in its own session, so stopping it kills its whole process group;
2. when tied to the parent, a tiny launcher sets PR_SET_PDEATHSIG before exec, so the kernel
   kills the component even if the owning Python process dies by SIGKILL;
3. the pids are recorded in the cluster's state file, so ``python -m devcluster down``
   can stop a detached cluster from another shell.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Runs in the child: arm the parent-death signal, make sure the parent did not already die
# in the window before prctl, then become the component. No preexec_fn, which is unsafe
# once the owner has threads (node heartbeaters do).
_LAUNCHER = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclass(frozen=True)
class ProcessRecord:
    """What ``down`` needs to find a component again: its pid and the binary it runs."""

    name: str
    pid: int
    executable: str


class ManagedProcess:
    """One control-plane component with its log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        tie_to_parent: bool,
        env: Mapping[str, str] | None = None,
    ):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = list(argv)
        if tie_to_parent and sys.platform.startswith("linux"):
            command = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv]
        with log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else dict(env),
            )
        self.record = ProcessRecord(name=name, pid=self._popen.pid, executable=str(argv[0]))

    @property
    def pid(self) -> int:
        return self._popen.pid

    def exit_code(self) -> int | None:
        return self._popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        return tail_of(self.log_path, lines)

    def kill(self, sig: int = signal.SIGKILL, wait_seconds: float = 10.0) -> None:
        """Signal the process itself (SIGKILL by default: a crash, nothing cleaned up) and
        wait until it has exited."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._popen.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=wait_seconds)

    def stop(self, grace_seconds: float = 5.0) -> None:
        if self._popen.poll() is None:
            terminate_group(self._popen.pid, grace_seconds, lambda: self._popen.poll() is None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=1.0)


def terminate_group(pgid: int, grace_seconds: float, alive: Callable[[], bool]) -> None:
    """SIGTERM the process group, wait, then SIGKILL whatever is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def stop_recorded(record: ProcessRecord, grace_seconds: float = 5.0) -> bool:
    """Stop a component started by another process; returns whether it was running.

    The pid is only signalled if it still runs the recorded binary, so a recycled pid of an
    unrelated process is never touched."""
    if not is_running(record):
        return False
    terminate_group(record.pid, grace_seconds, lambda: is_running(record))
    return True


def console_script(name: str, module: str) -> list[str]:
    """The command of an installed console script next to this interpreter, else ``-m``."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [sys.executable, str(script)]
    return [sys.executable, "-m", module]


def tail_of(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def is_running(record: ProcessRecord) -> bool:
    """Whether the recorded pid is alive and still runs the recorded binary."""
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{record.pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False  # a zombie has already exited; it only waits to be reaped
    wanted = record.executable.encode()
    return any(part == wanted for part in cmdline)
