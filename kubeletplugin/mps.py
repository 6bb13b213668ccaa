"""MPS control daemons: one per claim with MPS sharing, on the claim's MIG slices.

The plugin starts ``nvidia-cuda-mps-control -d`` from the driver root with
``CUDA_VISIBLE_DEVICES`` naming the claim's MIG devices and its own pipe and log directories
(``<base>/<claim UID>/pipe`` and ``/log``), then sends the claim's settings through the control
client (``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``).
Containers get the pipe directory mounted and ``CUDA_MPS_PIPE_DIRECTORY`` pointing at it, so
every process of every pod that shares the claim talks to that one daemon.

Only NVIDIA's documented interface is used (the pid file ``nvidia-cuda-mps-control.pid`` in
the pipe directory, commands on the client's standard input, ``quit``), so the same code drives
the real daemon and the simulator's stand-in (``driver.nvml.sim.mpscontrol``).

The settings sent are also kept in ``<base>/<claim UID>/commands``, so a daemon found dead
after a restart is started again with the same settings without reading the claim.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from driver.cdi import Mount
from driver.config import MpsConfig
from driver.driverroot import BINARY_DIRS, host_path
from kubeletplugin.checkpoint import MpsDaemon

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA looks by default, and the real daemon's
PIPE_OPTIONS = ("nosuid", "nodev", "bind", "noexec")  # clients make FIFOs there: not read-only


class MpsError(Exception):
    """The daemon could not be started, configured or reached; the message says which."""


def find_binary(driver_root: Path) -> Path | None:
    """``nvidia-cuda-mps-control`` under the driver root (a host path), or None."""
    for d in BINARY_DIRS:
        candidate = Path(host_path(driver_root, f"{d}/{BINARY}"))
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def commands_for(config: MpsConfig, devices: int) -> tuple[str, ...]:
    """The control commands that apply `config` to a daemon serving `devices` devices."""
    out = []
    if config.default_active_thread_percentage is not None:
        out.append(
            f"set_default_active_thread_percentage {config.default_active_thread_percentage}"
        )
    limit = config.default_pinned_device_memory_limit_bytes
    if limit is not None:
        mib = max(1, limit // 2**20)
        out.extend(f"set_default_device_pinned_mem_limit {i} {mib}M" for i in range(devices))
    return tuple(out)


def _alive(pid: int) -> bool:
    """A running process (a zombie is not), whose command line names the control daemon."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    if stat.rpartition(")")[2].split()[0] in ("Z", "X"):
        return False
    return BINARY.encode() in cmdline


@dataclass
class MpsControl:
    """Starts, checks and stops the MPS control daemons of claims, under `base_dir`."""

    binary: Path | None
    base_dir: Path
    timeout: float = 10.0
    stop_grace: float = 5.0

    @property
    def available(self) -> bool:
        return self.binary is not None

    # -- paths and records -----------------------------------------------------------------

    def intent(self, claim_uid: str, visible_devices: Sequence[str]) -> MpsDaemon:
        """The record to checkpoint before the daemon is started."""
        top = self.base_dir / claim_uid
        return MpsDaemon(str(top / "pipe"), str(top / "log"), tuple(visible_devices))

    def mount(self, d: MpsDaemon) -> Mount:
        return Mount(d.pipe_dir, CONTAINER_PIPE_DIR, PIPE_OPTIONS)

    def container_env(self) -> Mapping[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}

    def _env(self, d: MpsDaemon) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CUDA_VISIBLE_DEVICES": ",".join(d.visible_devices),
            "CUDA_MPS_PIPE_DIRECTORY": d.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": d.log_dir,
        }

    def _commands_file(self, d: MpsDaemon) -> Path:
        return Path(d.pipe_dir).parent / "commands"

    # -- the control client ----------------------------------------------------------------

    def command(self, d: MpsDaemon, *lines: str) -> str:
        """Send `lines` through the control client; its output, or MpsError."""
        if self.binary is None:
            raise MpsError(f"{BINARY} was not found in the driver root")
        try:
            out = subprocess.run(
                [str(self.binary)],
                input="".join(f"{line}\n" for line in lines),
                env=self._env(d),
                capture_output=True,
                text=True,
                timeout=self.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise MpsError(f"the MPS control daemon did not answer within {self.timeout}s") from e
        if out.returncode != 0:
            why = (out.stderr or out.stdout).strip() or f"exit status {out.returncode}"
            raise MpsError(f"{BINARY} {' / '.join(lines)!r}: {why}")
        return out.stdout

    def pid_of(self, d: MpsDaemon) -> int | None:
        """The daemon's pid: the recorded one, else its pid file's; None if not running."""
        candidates = [d.pid] if d.pid is not None else []
        with contextlib.suppress(OSError, ValueError):
            candidates.append(int((Path(d.pipe_dir) / PID_FILE).read_text().strip()))
        return next((p for p in candidates if _alive(p)), None)

    def answering(self, d: MpsDaemon) -> bool:
        """Its process is alive and its control pipe answers."""
        if self.pid_of(d) is None:
            return False
        try:
            self.command(d, "get_server_list")
        except MpsError:
            return False
        return True

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, d: MpsDaemon, commands: Sequence[str] | None = None) -> MpsDaemon:
        """Start the daemon of `d`, wait until it answers, send `commands` (None: the ones
        saved when it was first started); the record with its pid."""
        if self.binary is None:
            raise MpsError(f"{BINARY} was not found in the driver root")
        Path(d.pipe_dir).mkdir(parents=True, exist_ok=True, mode=0o755)
        Path(d.log_dir).mkdir(parents=True, exist_ok=True, mode=0o755)
        saved = self._commands_file(d)
        if commands is None:
            commands = saved.read_text().splitlines() if saved.exists() else ()
        else:
            saved.write_text("".join(f"{c}\n" for c in commands))
        started = subprocess.run(
            [str(self.binary), "-d"],
            env=self._env(d),
            capture_output=True,
            text=True,
            timeout=self.timeout,
            start_new_session=True,  # the daemon outlives a crash of the plugin
            check=False,
        )
        if started.returncode != 0:
            raise MpsError(
                f"{BINARY} -d failed (exit status {started.returncode}): "
                f"{started.stderr.strip() or started.stdout.strip()}"
            )
        deadline = time.monotonic() + self.timeout
        while True:
            pid = self.pid_of(d)
            if pid is not None and self.answering(replace(d, pid=pid)):
                break
            if time.monotonic() > deadline:
                raise MpsError(
                    f"the MPS control daemon started but did not answer within {self.timeout}s "
                    f"(log: {d.log_dir})"
                )
            time.sleep(0.05)
        running = replace(d, pid=pid)
        if commands:
            self.command(running, *commands)
        return running

    def stop(self, d: MpsDaemon, *, forget: bool = True) -> None:
        """`quit`, then SIGKILL if it lingers; with `forget` its directories (saved settings
        included) are removed too. Idempotent."""
        pid = self.pid_of(d)
        if pid is not None:
            try:
                self.command(d, "quit")
            except MpsError as e:
                log.warning("MPS control daemon did not take quit", extra={"error": str(e)})
            deadline = time.monotonic() + self.stop_grace
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                log.warning("MPS control daemon lingers after quit; killing it", extra={"pid": pid})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        top = Path(d.pipe_dir).parent
        if forget and top.parent == self.base_dir:
            shutil.rmtree(top, ignore_errors=True)
