"""Injected faults: an NVML error, a hang, or a SIGKILL at a named step of a named operation
(sim-only).

Faults live in the state file rather than in the process, so a test can arm one in its own
process and have it fire inside the plugin it started, and a fault that fired is consumed
durably before it acts: a process killed by it does not meet it again after a restart.

A hang is what a sick GPU's NVML calls often do instead of failing: the call does not return
until the test says so (`sim_release_hangs`), as a real call returns once the driver gives up
or the GPU recovers. It waits outside the state lock, so only that call hangs: other calls,
on that GPU or another, and other processes go on. ``before`` hangs with nothing changed yet
(the operation runs once released); ``after`` hangs with the change made, the answer held.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
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

_HANG_POLL_SECONDS = 0.02


def fire(store: StateStore, state: HwState, op: str, gpu: int | None, when: str) -> int | None:
    """Act on the first armed fault matching (``op``, ``gpu``, this process's tag, ``when``).
    For a hang, the hold is recorded and its id returned: the caller waits for its release
    (`wait_released`) once it has let go of the state lock."""
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
        if fault.action == "hang":
            hold = state.next_serial()
            state.hangs.append({"id": hold, "op": op, "gpu": gpu, "when": when})
            store.save_now(state)
            return hold
        raise_nvml(fault.code)
    return None


def wait_released(store: StateStore, hold: int) -> None:
    """Block until the hold ``hold`` is released (its entry gone from the state file)."""
    while True:
        with store.transaction() as state:
            if all(h["id"] != hold for h in state.hangs):
                return
        time.sleep(_HANG_POLL_SECONDS)


def sim_inject_fault(
    op: str,
    *,
    error: int | str | None = None,
    kill: bool = False,
    hang: bool = False,
    when: str = "before",
    times: int = 1,
    gpu: int | None = None,
    tag: str | None = None,
) -> None:
    """Make ``op`` fail with NVML ``error`` (a code or a name like "INSUFFICIENT_RESOURCES"),
    hang until `sim_release_hangs` (``hang``), or kill the calling process with SIGKILL,
    ``times`` times, ``before`` or ``after`` the operation takes effect. Faults live in the
    state file, so they reach other processes."""
    action = "kill" if kill else "hang" if hang else "error"
    raw: dict[str, Any] = {"op": op, "when": when, "action": action}
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


def sim_clear_faults(*, gpu: int | None = None) -> None:
    """Disarm every fault and release every hung call (those on GPU ``gpu`` only, with it)."""

    def body(cfg: SimConfig, state: HwState) -> None:
        if gpu is None:
            state.faults, state.hangs = [], []
            return
        state.faults = [f for f in state.faults if f.get("gpu") != gpu]
        state.hangs = [h for h in state.hangs if h.get("gpu") != gpu]

    admin(body)


def sim_hung_calls() -> list[Mapping[str, Any]]:
    """The calls a hang fault holds now, each {"id", "op", "gpu", "when"} (sim-only)."""
    return admin(lambda cfg, state: [dict(h) for h in state.hangs])


def sim_release_hangs(*, gpu: int | None = None) -> int:
    """Let the hung calls (on GPU ``gpu``, or all) return, and disarm the hang faults not yet
    met there, as a GPU that recovers answers again. Returns how many calls were released."""

    def body(cfg: SimConfig, state: HwState) -> int:
        def on_it(g: int | None) -> bool:
            return gpu is None or g is None or g == gpu

        held = [h for h in state.hangs if on_it(h["gpu"])]
        state.hangs = [h for h in state.hangs if h not in held]
        state.faults = [f for f in state.faults if not (f["action"] == "hang" and on_it(f["gpu"]))]
        return len(held)

    return admin(body)
