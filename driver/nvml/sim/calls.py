"""The frame every simulated NVML call runs in, and the checks NVML makes before it acts.

``call`` makes each call one transaction on the state file: the configured latency is slept
first, outside the lock; then the "before" fault point, the operation and the "after" fault point
run under the file lock, so a fault that kills at either point leaves the old or the new state,
as a process killed around a real NVML call does. A hang at either point waits outside the lock
(sim.faults), so only the hung call stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from driver.catalog import ProfileSpec
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.faults import fire, wait_released
from driver.nvml.sim.handles import Resolved, decode
from driver.nvml.sim.hardware import HwState
from driver.nvml.sim.runtime import raise_nvml, require_init, state_store

_T = TypeVar("_T")


def _latency(cfg: SimConfig, op: str, index: int | None) -> float:
    if index is not None and index < len(cfg.gpus):
        arch = cfg.gpus[index].model.architecture.value
        if f"{op}.{arch}" in cfg.latency:
            return cfg.latency[f"{op}.{arch}"]
    return cfg.latency.get(op, 0.0)


def call(op: str, handle: Any, body: Callable[[SimConfig, HwState], _T]) -> _T:
    """Run ``body`` as NVML operation ``op`` on the GPU ``handle`` names (None: no GPU)."""
    cfg = require_init()
    index: int | None = None
    if handle is not None:
        index = decode(handle)[1]
    delay = _latency(cfg, op, index)
    if delay > 0:
        time.sleep(delay)
    store = state_store(cfg)
    released = False
    while True:
        with store.transaction() as state:
            hold = None if released else fire(store, state, op, index, "before")
            if hold is None:
                result = body(cfg, state)
                after = fire(store, state, op, index, "after")
                break
        wait_released(store, hold)  # then the operation runs, as a call that got unstuck
        released = True
    if after is not None:
        wait_released(store, after)
    return result


def require_privilege(cfg: SimConfig) -> None:
    if not cfg.privileged:
        raise_nvml(pynvml.NVML_ERROR_NO_PERMISSION)


def require_mig_capable(r: Resolved) -> None:
    if not r.gpu.mig_capable:
        raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)


def require_mig_enabled(r: Resolved) -> None:
    require_mig_capable(r)
    if r.gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
        raise_nvml(pynvml.NVML_ERROR_NOT_SUPPORTED)


def profile_by_id(r: Resolved, profile_id: int) -> ProfileSpec:
    """The GPU-instance profile ``profile_id`` of the resolved GPU, or INVALID_ARGUMENT."""
    prof = next((p for p in r.model.profiles if p.id == profile_id), None)
    if prof is None:
        raise_nvml(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert prof is not None
    return prof
