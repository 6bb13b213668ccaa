"""Injected faults: an NVML error or a SIGKILL at a named step of a named operation (sim-only).

Faults live in the state file rather than in the process, so a test can arm one in its own
process and have it fire inside the plugin it started, and a fault that fired is consumed
durably before it acts: a process killed by it does not meet it again after a restart.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from driver.nvml.sim.config import (
    ENV_FAULT_TAG,
    Fault,
    SimConfig,
    SimConfigError,
    parse_fault,
)
from driver.nvml.sim.hardware import HwState, StateStore
from driver.nvml.sim.runtime import admin, raise_nvml


def fire(store: StateStore, state: HwState, op: str, gpu: int | None, when: str) -> None:
    """Act on the first armed fault matching (``op``, ``gpu``, this process's tag, ``when``)."""
    tag = os.environ.get(ENV_FAULT_TAG)
    for raw in state.faults:
        fault = Fault(**{k: v for k, v in raw.items() if k != "remaining"})
        if raw["remaining"] <= 0 or fault.when != when or not fault.matches(op, gpu, tag):
            continue
        raw["remaining"] -= 1
        state.faults = [f for f in state.faults if f["remaining"] > 0]
        store.save_now(state)  # consume the fault durably before acting on it
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # pragma: no cover -- SIGKILL is not deliverable late
        raise_nvml(fault.code)


def sim_inject_fault(
    op: str,
    *,
    error: int | str | None = None,
    kill: bool = False,
    when: str = "before",
    times: int = 1,
    gpu: int | None = None,
    tag: str | None = None,
) -> None:
    """Make ``op`` fail with NVML ``error`` (a code or a name like "INSUFFICIENT_RESOURCES"),
    or kill the calling process with SIGKILL, ``times`` times, ``before`` or ``after`` the
    operation takes effect. Faults live in the state file, so they reach other processes."""
    raw: dict[str, Any] = {"op": op, "when": when, "action": "kill" if kill else "error"}
    raw["times"] = times
    if error is not None:
        raw["error"] = error
    if gpu is not None:
        raw["gpu"] = gpu
    if tag is not None:
        raw["tag"] = tag
    fault = parse_fault(raw)

    def body(cfg: SimConfig, state: HwState) -> None:
        state.faults.append({**fault.to_json(), "remaining": fault.times})

    admin(body)


def sim_crash_at(
    point: str, *, times: int = 1, gpu: int | None = None, tag: str | None = None
) -> None:
    """Kill the process at ``"before:<Op>"`` or ``"after:<Op>"`` (sim-only)."""
    when, sep, op = point.partition(":")
    if not sep:
        raise SimConfigError(f"crash point {point!r}: write 'before:<Op>' or 'after:<Op>'")
    sim_inject_fault(op, kill=True, when=when, times=times, gpu=gpu, tag=tag)


def sim_clear_faults() -> None:
    def body(cfg: SimConfig, state: HwState) -> None:
        state.faults = []

    admin(body)
