"""nvmlDeviceGetComputeRunningProcesses: which processes run on a GPU or on one MIG device.

NVML answers per MIG device when given a MIG device handle (each entry names its GPU and
compute instance ids) and aggregates every MIG device when given the parent GPU's handle.
A stale MIG handle (its instance destroyed) is INVALID_ARGUMENT, as for every other call.
Processes are put on a compute instance with ``admin.sim_set_processes`` (or ``sim_set_busy``),
so a test can make "a process is still running on the slice" true or false.
"""

# ruff: noqa: N802, N816 -- names mirror pynvml exactly; that is the point.
from __future__ import annotations

from typing import Any

import pynvml

from driver.nvml.sim.calls import call
from driver.nvml.sim.config import SimConfig
from driver.nvml.sim.handles import KIND_DEVICE, KIND_MIG, resolve
from driver.nvml.sim.hardware import CiRec, GiRec, HwState

# What NVML reports when it cannot tell a process's memory use (pynvml turns it into None).
_MEMORY_UNKNOWN = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value


def _entries(gi: GiRec, ci: CiRec) -> list[Any]:
    out = []
    for pid in ci.pids:
        info = pynvml.c_nvmlProcessInfo_t()
        info.pid = pid
        info.usedGpuMemory = _MEMORY_UNKNOWN
        info.gpuInstanceId = gi.id
        info.computeInstanceId = ci.id
        friendly = pynvml.nvmlStructToFriendlyObject(info)
        friendly.usedGpuMemory = None
        out.append(friendly)
    return out


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
    def body(cfg: SimConfig, state: HwState) -> list[Any]:
        r = resolve(cfg, state, handle, (KIND_DEVICE, KIND_MIG))
        if r.ci is not None:
            assert r.gi is not None
            return _entries(r.gi, r.ci)
        return [e for gi in r.gpu.gis for ci in gi.cis for e in _entries(gi, ci)]

    return call("DeviceGetComputeRunningProcesses", handle, body)


nvmlDeviceGetComputeRunningProcesses_v3 = nvmlDeviceGetComputeRunningProcesses
