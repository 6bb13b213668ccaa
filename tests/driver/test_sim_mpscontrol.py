"""The simulator's nvidia-cuda-mps-control stand-in speaks the documented control protocol."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.sim import driverfiles
from driver.nvml.sim.mpscontrol import CONTROL_LOG, MPS_CONTROL, PID_FILE


@pytest.fixture
def mps(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    root = tmp_path / "driver"
    driverfiles.populate_driver_root(root, "580.65.06")
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
        "CUDA_VISIBLE_DEVICES": "MIG-1234",
    }
    yield root / MPS_CONTROL, env
    pid_file = tmp_path / "pipe" / PID_FILE
    if pid_file.exists():  # a test that failed half-way: never leave a daemon behind
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), 9)


def _client(binary: Path, env: dict[str, str], commands: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary)],
        check=False,
        input=commands,
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_daemon_answers_records_and_quits(mps: tuple[Path, dict[str, str]]) -> None:
    binary, env = mps
    pipe, logdir = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    started = subprocess.run(
        [str(binary), "-d"],
        check=False,
        env=env,
        timeout=10,
        start_new_session=True,
        capture_output=True,
    )
    assert started.returncode == 0, started.stderr
    pid = int((pipe / PID_FILE).read_text())
    assert _alive(pid)
    assert (pipe / "control").is_fifo()

    out = _client(
        binary,
        env,
        "get_default_active_thread_percentage\n"
        "set_default_active_thread_percentage 40\n"
        "set_default_device_pinned_mem_limit 0 2048M\n"
        "get_server_list\n",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["100.0", "40.0"]
    again = _client(
        binary, env, "get_default_active_thread_percentage\nget_default_device_pinned_mem_limit 0\n"
    )
    assert again.stdout.split() == ["40.0", "2048M"]
    bad = _client(binary, env, "set_default_active_thread_percentage lots\nfrobnicate\n")
    assert bad.returncode == 1
    assert "Invalid percentage lots" in bad.stdout and "Unknown command: frobnicate" in bad.stdout

    second = subprocess.run(
        [str(binary), "-d"], check=False, env=env, timeout=10, capture_output=True
    )
    assert second.returncode == 1 and b"already running" in second.stderr

    assert _client(binary, env, "quit\n").returncode == 0
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert not (pipe / PID_FILE).exists() and not (pipe / "control").exists()
    log = (logdir / CONTROL_LOG).read_text()
    assert "CUDA_VISIBLE_DEVICES=MIG-1234" in log
    assert "CMD set_default_active_thread_percentage 40" in log
    assert "CMD set_default_device_pinned_mem_limit 0 2048M" in log
    assert "CMD quit" in log
    assert list(pipe.glob("reply.*")) == []


def test_in_the_foreground_the_process_started_is_the_daemon(
    mps: tuple[Path, dict[str, str]],
) -> None:
    """`-f`: the pid is the one fork gave (carve never reads the pid file), the daemon answers,
    and SIGTERM (a pod's deletion) ends it as quit does."""
    binary, env = mps
    pipe, logdir = Path(env["CUDA_MPS_PIPE_DIRECTORY"]), Path(env["CUDA_MPS_LOG_DIRECTORY"])
    daemon = subprocess.Popen(
        [str(binary), "-f"],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while (out := _client(binary, env, "get_default_active_thread_percentage\n")).returncode:
            assert daemon.poll() is None and time.monotonic() < deadline, out.stderr
            time.sleep(0.05)
        assert out.stdout.split() == ["100.0"]
        assert int((pipe / PID_FILE).read_text()) == daemon.pid
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=10)
    finally:
        if daemon.poll() is None:
            daemon.kill()
    assert daemon.returncode == 0
    assert b"Starting control daemon" in err and b"Control daemon exiting" in err
    assert not (pipe / PID_FILE).exists() and not (pipe / "control").exists()
    assert "Control daemon exiting" in (logdir / CONTROL_LOG).read_text()


def test_client_without_daemon_says_so(mps: tuple[Path, dict[str, str]]) -> None:
    binary, env = mps
    out = _client(binary, env, "get_server_list\n")
    assert out.returncode == 1
    assert "Cannot find MPS control daemon process" in out.stderr


def test_stand_in_is_written_with_the_marker(tmp_path: Path) -> None:
    driverfiles.populate_driver_root(tmp_path, "580.65.06")
    script = tmp_path / MPS_CONTROL
    assert script.stat().st_mode & 0o111
    assert driverfiles.MARKER in script.read_text()[:256]


def test_a_command_sent_before_the_daemon_reads_is_answered(
    mps: tuple[Path, dict[str, str]],
) -> None:
    """A client may write the moment `-d` returns, before the daemon has read anything: its
    command must wait in the control FIFO, not be dropped (a FIFO that nobody holds open
    discards what is written to it, and the client would wait for a reply forever)."""
    binary, env = mps
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    started = subprocess.run([str(binary), "-d"], env=env, timeout=10, start_new_session=True,
                             capture_output=True, check=False)  # fmt: skip
    assert started.returncode == 0, started.stderr
    pid = int((pipe / PID_FILE).read_text())
    os.kill(pid, signal.SIGSTOP)  # the daemon reads nothing until it is continued
    try:
        client = subprocess.Popen(
            [str(binary)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert client.stdin is not None
        client.stdin.write("get_default_active_thread_percentage\n")
        client.stdin.close()
        time.sleep(0.5)  # the client has written its command by now, and waits
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.wait(timeout=10) == 0
    assert client.stdout is not None and client.stdout.read().strip() == "100.0"
    assert _client(binary, env, "quit\n").returncode == 0
