"""MPS control daemons: one per claim with MPS sharing, on the claim's MIG slices or GPUs.

The plugin starts ``nvidia-cuda-mps-control -f`` from the driver root with
``CUDA_VISIBLE_DEVICES`` naming the claim's MIG devices (or whole GPUs) and its own pipe and log
directories (``<base>/<claim UID>/pipe`` and ``/log``), then sends the claim's settings through
the control client (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``).
Containers get the pipe directory mounted and ``CUDA_MPS_PIPE_DIRECTORY`` pointing at it, so
every process of every pod that shares the claim talks to that one daemon.

Where a daemon runs decides what it outlives, so there are two places:

- ``ChildProcesses``: a child of the plugin in a session of its own. It outlives a crash of a
  plugin run as a host process (the real-node suites and the unit harness run it so), but not
  the end of a container the plugin is PID 1 of: the kernel kills every process of a PID
  namespace with its init, and with ``hostPID`` containerd kills the container's cgroup.
- ``DaemonPods`` (kubeletplugin.mpspods): a pod of its own per claim, on the plugin's node in
  the plugin's namespace, started and supervised by the kubelet. It outlives the plugin's pod
  (a crash, a deletion, a chart upgrade), which is why the chart runs daemons so
  (``--mps-daemon-image``).

Which daemon belongs to a claim is never read from the pipe directory: that directory is
mounted writable into the claim's containers, so its ``nvidia-cuda-mps-control.pid`` says
whatever a tenant wrote there, and a plugin that believed it could be made to kill another
claim's daemon. A child's pid comes from fork (``-f`` keeps the daemon in the process the
plugin started), and a process is taken for the claim's daemon only when its command line runs
the control daemon and its environment names the claim's pipe directory, which the process of
another claim's daemon never does. A pod is named after the claim before it is created.

Only NVIDIA's documented interface is used (``-f``, commands on the client's standard input,
``quit``), so the same code drives the real daemon and the simulator's stand-in
(``driver.nvml.sim.mpscontrol``).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from driver.cdi import Mount
from driver.config import MpsConfig
from driver.driverroot import BINARY_DIRS, host_path
from kubeletplugin.checkpoint import MpsDaemon

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon's; in the tenants' directory, never read
OUTPUT = "daemon.out"  # a child daemon's standard output and error, in its log directory
CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"  # where CUDA looks by default, and the real daemon's
PIPE_OPTIONS = ("nosuid", "nodev", "bind", "noexec")  # clients make FIFOs there: not read-only
_PROBE_SECONDS = 2.0  # one `get_server_list` while waiting for a new daemon to answer


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


def _is_daemon_of(pid: int, pipe_dir: str) -> bool:
    """`pid` is a live control daemon (started with -f or -d) whose environment names
    `pipe_dir`: the daemon of that claim, and never another claim's, whatever pid a tenant
    wrote anywhere (a recycled pid is some other process, and fails the same test)."""
    if not _alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    daemon = any(a in (b"-f", b"-d") for a in argv) and any(
        a.rsplit(b"/", 1)[-1] == BINARY.encode() for a in argv
    )
    return daemon and f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode() in environ


class DaemonRunner(Protocol):
    """Where daemons run: starts one, tells whether it still runs, makes sure it is gone."""

    start_timeout: float | None  # how long a new daemon may take to answer (None: the control's)
    poll_seconds: float

    def intent(self, d: MpsDaemon, claim_uid: str) -> MpsDaemon:
        """`d` with what names its daemon before it is started (a pod's name), if anything."""

    def launch(self, binary: Path, d: MpsDaemon, env: Mapping[str, str]) -> MpsDaemon:
        """Start `binary -f` for `d` with `env`; the record that names the daemon."""

    def running(self, d: MpsDaemon) -> bool:
        """Its daemon runs; MpsError when that cannot be told (the API is unreachable)."""

    def failed(self, d: MpsDaemon) -> str | None:
        """Why a daemon being started will never answer (it exited, its pod cannot start),
        or None while it still may."""

    def terminate(self, d: MpsDaemon, grace: float) -> None:
        """After `quit`: make sure it is gone (SIGKILL, or delete its pod and wait); MpsError
        when that cannot be done now."""


class ChildProcesses:
    """Daemons as children of the plugin, each in a session of its own (see the module)."""

    start_timeout: float | None = None
    poll_seconds = 0.05

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # reaped when they end

    def intent(self, d: MpsDaemon, claim_uid: str) -> MpsDaemon:
        return replace(d, pid=None, pod=None)

    def launch(self, binary: Path, d: MpsDaemon, env: Mapping[str, str]) -> MpsDaemon:
        try:
            with open(Path(d.log_dir) / OUTPUT, "ab") as out:
                child = subprocess.Popen(
                    [str(binary), "-f"],
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the daemon outlives a crash of the plugin
                )
        except OSError as e:
            raise MpsError(f"{binary} -f could not be started: {e}") from e
        self._children[child.pid] = child
        return replace(d, pid=child.pid, pod=None)

    def _reap(self, pid: int) -> int | None:
        """The exit status of our child `pid` once it has ended (and been reaped), else None."""
        child = self._children.get(pid)
        return None if child is None else child.poll()

    def running(self, d: MpsDaemon) -> bool:
        if d.pid is None:
            return False
        self._reap(d.pid)
        return _is_daemon_of(d.pid, d.pipe_dir)

    def failed(self, d: MpsDaemon) -> str | None:
        if d.pid is None:
            return "it was never started"
        status = self._reap(d.pid)
        if status is None and _is_daemon_of(d.pid, d.pipe_dir):
            return None
        try:
            said = (Path(d.log_dir) / OUTPUT).read_text(errors="replace").strip()[-500:]
        except OSError:
            said = ""
        ended = f"exited with status {status}" if status is not None else "is gone"
        return f"the daemon (pid {d.pid}) {ended}" + (f"; {OUTPUT} ends: {said}" if said else "")

    def terminate(self, d: MpsDaemon, grace: float) -> None:
        if d.pid is None:
            return
        deadline = time.monotonic() + grace
        while self.running(d) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.running(d):
            log.warning("MPS control daemon lingers after quit; killing it", extra={"pid": d.pid})
            with contextlib.suppress(ProcessLookupError):
                os.kill(d.pid, signal.SIGKILL)
        child = self._children.pop(d.pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=grace)


@dataclass
class MpsControl:
    """Starts, checks and stops the MPS control daemons of claims, under `base_dir`: in pods
    when `pods` is given, else as children of the plugin."""

    binary: Path | None
    base_dir: Path
    timeout: float = 10.0
    stop_grace: float = 5.0
    pods: DaemonRunner | None = None
    _children: ChildProcesses = field(default_factory=ChildProcesses, init=False, repr=False)

    @property
    def available(self) -> bool:
        return self.binary is not None

    def _runner(self) -> DaemonRunner:
        """Where new daemons run."""
        return self.pods if self.pods is not None else self._children

    def _runner_of(self, d: MpsDaemon) -> DaemonRunner:
        """Where the daemon of `d` runs: a record keeps its place across a change of flags."""
        if d.pod is None:
            return self._children
        if self.pods is None:
            raise MpsError(
                f"the daemon runs in pod {d.pod}, but this plugin runs without "
                "--mps-daemon-image and cannot reach pods; start it with the flag again, or "
                "delete that pod by hand"
            )
        return self.pods

    # -- paths and records -----------------------------------------------------------------

    def intent(self, claim_uid: str, visible_devices: Sequence[str]) -> MpsDaemon:
        """The record to checkpoint before the daemon is started."""
        top = self.base_dir / claim_uid
        d = MpsDaemon(str(top / "pipe"), str(top / "log"), tuple(visible_devices))
        return self._runner().intent(d, claim_uid)

    def renewed(self, d: MpsDaemon, claim_uid: str) -> MpsDaemon:
        """The record to start a daemon again with, in the same directories, where new
        daemons run now."""
        return self._runner().intent(replace(d, pid=None, pod=None), claim_uid)

    def describe(self, d: MpsDaemon) -> str:
        """Which daemon, for messages: its pod or its pid."""
        if d.pod is not None:
            return f"pod {d.pod}"
        return "not started" if d.pid is None else f"pid {d.pid}"

    def mount(self, d: MpsDaemon) -> Mount:
        return Mount(d.pipe_dir, CONTAINER_PIPE_DIR, PIPE_OPTIONS)

    def container_env(self) -> Mapping[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR}

    def env(self, d: MpsDaemon) -> dict[str, str]:
        """The daemon's environment (and its control client's)."""
        return {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "CUDA_VISIBLE_DEVICES": ",".join(d.visible_devices),
            "CUDA_MPS_PIPE_DIRECTORY": d.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": d.log_dir,
        }

    def _commands_file(self, d: MpsDaemon) -> Path:
        return Path(d.pipe_dir).parent / "commands"

    # -- the control client ----------------------------------------------------------------

    def command(self, d: MpsDaemon, *lines: str, timeout: float | None = None) -> str:
        """Send `lines` through the control client; its output, or MpsError."""
        if self.binary is None:
            raise MpsError(f"{BINARY} was not found in the driver root")
        limit = self.timeout if timeout is None else timeout
        try:
            out = subprocess.run(
                [str(self.binary)],
                input="".join(f"{line}\n" for line in lines),
                env=self.env(d),
                capture_output=True,
                text=True,
                timeout=limit,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise MpsError(f"the MPS control daemon did not answer within {limit}s") from e
        if out.returncode != 0:
            why = (out.stderr or out.stdout).strip() or f"exit status {out.returncode}"
            raise MpsError(f"{BINARY} {' / '.join(lines)!r}: {why}")
        return out.stdout

    def running(self, d: MpsDaemon) -> bool:
        """Its daemon runs (never judged by the pid file); MpsError when that cannot be told."""
        return self._runner_of(d).running(d)

    def answering(self, d: MpsDaemon) -> bool:
        """Its daemon runs and its control pipe answers; MpsError when that cannot be told."""
        if not self.running(d):
            return False
        try:
            self.command(d, "get_server_list")
        except MpsError:
            return False
        return True

    # -- lifecycle ---------------------------------------------------------------------------

    def start(
        self,
        d: MpsDaemon,
        commands: Sequence[str] | None = None,
        *,
        launched: Callable[[MpsDaemon], object] = lambda d: None,
    ) -> MpsDaemon:
        """Start the daemon of `d`, hand the record that names it to `launched` (to be
        checkpointed before anything else can fail), wait until it answers, send `commands`
        (None: the ones saved when it was first started); the record."""
        if self.binary is None:
            raise MpsError(f"{BINARY} was not found in the driver root")
        Path(d.pipe_dir).mkdir(parents=True, exist_ok=True, mode=0o755)
        Path(d.log_dir).mkdir(parents=True, exist_ok=True, mode=0o755)
        saved = self._commands_file(d)
        if commands is None:
            commands = saved.read_text().splitlines() if saved.exists() else ()
        else:
            saved.write_text("".join(f"{c}\n" for c in commands))
        runner = self._runner_of(d)
        running = runner.launch(self.binary, d, self.env(d))
        launched(running)
        self._wait_answering(runner, running)
        if commands:
            self.command(running, *commands)
        return running

    def _wait_answering(self, runner: DaemonRunner, d: MpsDaemon) -> None:
        limit = runner.start_timeout or self.timeout
        deadline = time.monotonic() + limit
        while True:
            with contextlib.suppress(MpsError):
                self.command(d, "get_server_list", timeout=min(_PROBE_SECONDS, self.timeout))
                return
            why = runner.failed(d)
            if why is not None:
                raise MpsError(f"the MPS control daemon did not start: {why}")
            if time.monotonic() > deadline:
                raise MpsError(
                    f"the MPS control daemon ({self.describe(d)}) did not answer within "
                    f"{limit}s (log: {d.log_dir})"
                )
            time.sleep(runner.poll_seconds)

    def stop(self, d: MpsDaemon, *, forget: bool = True) -> None:
        """`quit`, then make sure it is gone (SIGKILL, or its pod deleted); with `forget` its
        directories (saved settings included) are removed too. Idempotent. MpsError when it
        cannot be made sure of now (its pod cannot be deleted)."""
        runner = self._runner_of(d)
        try:
            up = runner.running(d)
        except MpsError:
            up = True  # cannot tell: ask it to quit all the same
        # Whatever listens on the claim's pipe is told to quit even when the recorded daemon
        # does not run: a child forked but not recorded yet (a crash right after fork), or one
        # a checkpoint lost track of. Only the claim's own daemon listens there. Not expected
        # to answer, it gets a short wait: a killed daemon leaves a control pipe nobody reads.
        try:
            self.command(d, "quit", timeout=None if up else _PROBE_SECONDS)
        except MpsError as e:
            if up:
                log.warning("MPS control daemon did not take quit", extra={"error": str(e)})
        runner.terminate(d, self.stop_grace)
        top = Path(d.pipe_dir).parent
        if forget and top.parent == self.base_dir:
            shutil.rmtree(top, ignore_errors=True)
