"""The test suite as lanes, each with its own time budget (issue 27.4).

Every test belongs to exactly one lane, by where it lives and what it needs (`lane_of`):

- ``realnode``: ``tests/realnode/``: real kubelets and containerd (root, Linux);
- ``e2e``: ``tests/e2e/``: the real controller and plugins on simulated nodes;
- ``cluster``: elsewhere, marked ``cluster`` or ``realnode``, or using the ``k8s_cluster``
  fixture: a control plane per suite, real processes, run one test at a time;
- ``unit``: everything else: in-process or short-lived child processes, on tmp paths only,
  so it runs in parallel (pytest-xdist, one worker per CPU).

The unit and cluster lanes collect the whole tree except the two lane directories and keep
their own tests (``--lane``, tests/conftest.py): a new test lands in a lane by construction,
never in none.

``python -m tests.support.lanes [LANE ...] [-- PYTEST_ARG ...]`` (``make test`` runs all four)
starts the lanes side by side, since the cluster lanes mostly wait on processes, each lane's
output going to
``.lanes/<lane>.log`` and printed whole when the lane ends; then one line per lane with its
time and budget. A lane over its budget says so (``LANE OVER BUDGET``) without failing the
run: a loaded machine is slow, not wrong. The exit status is non-zero when a lane failed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / ".lanes"
OWN_DIRS = {"e2e": "tests/e2e", "realnode": "tests/realnode"}
TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")  # pytest's python_files


@dataclass(frozen=True)
class Lane:
    name: str
    budget_s: int
    paths: tuple[str, ...]
    what: str
    ignore: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pytest_args(self) -> tuple[str, ...]:
        return (*self.paths, *(f"--ignore={d}" for d in self.ignore), *self.options)

    def reaches(self, path: Path) -> bool:
        """Whether this lane's pytest collects the file at ``path`` (relative to the
        repository); which of its tests the lane then keeps is `lane_of`'s answer."""
        return any(path.is_relative_to(p) for p in self.paths) and not any(
            path.is_relative_to(d) for d in self.ignore
        )


_OWN = tuple(OWN_DIRS.values())

# Budgets: each lane's wall time in a warm `make test` on the 2-core CI machine, where the
# four lanes run side by side and share the two cores, with about 20% margin. The fresh-clone
# CI run of 2026-12-03 took unit 9:18, cluster 10:27, e2e 12:58 and realnode 9:20 so (the
# first budgets, measured with each lane alone, were exceeded by every run of `make test`).
LANES: dict[str, Lane] = {
    lane.name: lane
    for lane in (
        Lane(
            "unit",
            660,
            ("tests",),
            "in-process and child-process tests, in parallel",
            ignore=_OWN,
            options=("-n", "auto", "--dist", "load"),
        ),
        Lane("cluster", 780, ("tests",), "a control plane per suite, one test at a time", _OWN),
        Lane("e2e", 900, (OWN_DIRS["e2e"],), "carve's processes on simulated nodes"),
        Lane("realnode", 720, (OWN_DIRS["realnode"],), "real kubelets and containerd"),
    )
}


def lane_of(path: Path, markers: Collection[str], fixtures: Collection[str]) -> str:
    """The one lane of the test at ``path`` (relative to the repository) with these marker
    and fixture names."""
    for lane, directory in OWN_DIRS.items():
        if path.is_relative_to(directory):
            return lane
    if {"cluster", "realnode"} & set(markers) or "k8s_cluster" in fixtures:
        return "cluster"
    return "unit"


def lanes_missing(path: Path) -> set[str]:
    """The lanes `lane_of` may give a test in the file at ``path`` whose pytest does not
    collect that file: such a test would run in no lane, so `make test` would never run it.
    Empty for every test file in the repository (tests/test_lanes.py)."""
    possible = {
        lane_of(path, markers, fixtures)
        for markers in ((), ("cluster",))
        for fixtures in ((), ("k8s_cluster",))
    }
    return {name for name in possible if not LANES[name].reaches(path)}


# -- the runner ----------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}:{s % 60:02d}"


@dataclass
class _Run:
    lane: Lane
    log: Path
    proc: subprocess.Popen[bytes]
    started: float
    ended: float | None = None
    cpu: float = 0.0  # user + system seconds of the lane's pytest and what it waited for

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def poll(self) -> bool:
        """True once the lane's pytest has exited (reaped here, for its CPU time)."""
        if self.ended is not None:
            return True
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.ended = time.monotonic()
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.cpu = usage.ru_utime + usage.ru_stime
        return True

    @property
    def over(self) -> bool:
        return self.seconds > self.lane.budget_s


def _start(lane: Lane, extra: Sequence[str]) -> _Run:
    LOGS.mkdir(exist_ok=True)
    log = LOGS / f"{lane.name}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "--lane", lane.name, *lane.pytest_args, *extra]
    with log.open("wb") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **lane.env}
        )
    print(
        f"lane {lane.name}: started ({lane.what}; budget {_clock(lane.budget_s)}; "
        f"log {log.relative_to(REPO)})",
        flush=True,
    )
    return _Run(lane, log, proc, time.monotonic())


def _report(run: _Run) -> None:
    result = "passed" if run.proc.returncode == 0 else f"FAILED (exit {run.proc.returncode})"
    bar = "=" * 20
    print(
        f"\n{bar} lane {run.lane.name}: {result} in {_clock(run.seconds)} "
        f"(cpu {_clock(run.cpu)}) {bar}",
        flush=True,
    )
    sys.stdout.buffer.write(run.log.read_bytes())
    if run.over:
        print(_over_line(run), flush=True)
    sys.stdout.flush()


def _over_line(run: _Run) -> str:
    return (
        f"LANE OVER BUDGET: {run.lane.name} took {_clock(run.seconds)}, "
        f"over its budget of {_clock(run.lane.budget_s)}"
    )


def _stop(runs: Sequence[_Run]) -> None:
    """Interrupt what still runs, as Ctrl-C would: pytest then stops its clusters and nodes."""
    alive = [r for r in runs if r.proc.poll() is None]
    for r in alive:
        r.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    for r in alive:
        try:
            r.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def run_lanes(names: Sequence[str], *, serial: bool, extra: Sequence[str]) -> int:
    lanes = [LANES[n] for n in names]
    pending = list(lanes)
    runs: list[_Run] = []
    began = time.monotonic()
    heartbeat = began
    try:
        while pending or any(r.ended is None for r in runs):
            if pending and (not serial or all(r.ended is not None for r in runs)):
                runs.append(_start(pending.pop(0), extra))
                continue
            time.sleep(0.5)
            for r in runs:
                if r.ended is None and r.poll():
                    _report(r)
            if time.monotonic() - heartbeat >= 120:
                heartbeat = time.monotonic()
                running = [f"{r.lane.name} {_clock(r.seconds)}" for r in runs if r.ended is None]
                print(f"lanes still running: {', '.join(running)}", flush=True)
    except BaseException:
        _stop(runs)
        raise
    print(f"\nlanes done in {_clock(time.monotonic() - began)}:", flush=True)
    for r in runs:
        result = "passed" if r.proc.returncode == 0 else "FAILED"
        print(
            f"  {r.lane.name:<9} {result:<7} {_clock(r.seconds):>6} "
            f"(budget {_clock(r.lane.budget_s)}, cpu {_clock(r.cpu)})"
            + ("  OVER BUDGET" if r.over else ""),
            flush=True,
        )
    for r in runs:
        if r.over:
            print(_over_line(r), flush=True)
    return 0 if all(r.proc.returncode == 0 for r in runs) else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.lanes",
        usage="%(prog)s [--serial] [LANE ...] [-- PYTEST_ARG ...]",
        description=f"Run test lanes ({', '.join(LANES)}; default: all) side by side.",
    )
    parser.add_argument("lanes", nargs="*", metavar="LANE")
    parser.add_argument("--serial", action="store_true", help="one lane after the other")
    args = parser.parse_args(own)
    unknown = [n for n in args.lanes if n not in LANES]
    if unknown:
        parser.error(f"no such lane: {', '.join(unknown)} (lanes: {', '.join(LANES)})")
    return run_lanes(args.lanes or list(LANES), serial=args.serial, extra=extra)


if __name__ == "__main__":
    sys.exit(main())
