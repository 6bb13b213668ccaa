"""A drop-in stand-in for the ``pynvml`` module that simulates MIG-capable GPUs.

``import driver.nvml.sim as nvml`` gives the same function names and argument shapes as
``pynvml`` (nvidia-ml-py) for everything carve's backend calls, returns pynvml's own ctypes
structs and handle types, and raises ``pynvml.NVMLError`` subclasses with the real codes, so
the backend cannot tell it from NVML. Handles are genuine ``c_nvmlDevice_t`` /
``c_nvmlGpuInstance_t`` / ``c_nvmlComputeInstance_t`` pointers whose address encodes what they
name; a handle to an instance that was destroyed (or destroyed and re-created) is stale and
gives ``NVML_ERROR_INVALID_ARGUMENT``.

The hardware state lives in a locked file (see ``hardware``), so it survives process restarts
and is shared by every process on the node that uses the same configuration.

Functions whose names start with ``sim_`` (and ``configure``) are simulator administration:
reset or reboot a GPU, inject faults, inspect state. NVML has nothing like them and the
product never calls them.

The package is the module callers import; its parts each hold one concern:

- ``config``: the config file (which GPUs, options, faults at start-up), validated;
- ``hardware``: the MIG rules NVML enforces and the file-backed, locked state;
- ``runtime``: the process's chosen config, nvmlInit's count, the open state store;
- ``handles``: handle pointers and ctypes out-parameters;
- ``calls``: the per-call transaction (latency, fault points, lock) and NVML's pre-checks;
- ``faults``: injected errors, hangs and kills, kept in the state file;
- ``hardware`` also lays out the node's fake ``/sys`` (the GPUs' PCI places);
- ``driverfiles``: the node's fake driver root (libraries, an ``nvidia-smi -L`` stand-in) and
  its device nodes under a dev root, kept in step with the state;
- ``devices``, ``gpu_instances``, ``compute_instances``: the pynvml-shaped functions;
- ``admin``: sim-only resets, reboots and inspection.
"""

# ruff: noqa: N816 -- pynvml's struct names are mixedCase; that is the point.
from __future__ import annotations

import pynvml

from driver.nvml.sim import config as _cfgmod
from driver.nvml.sim.admin import (
    LayoutInstance,
    sim_boot_id,
    sim_boot_layout,
    sim_lose_gpu,
    sim_node_files,
    sim_proc_root,
    sim_reboot,
    sim_reset_gpu,
    sim_set_busy,
    sim_set_gpu_clients,
    sim_set_processes,
    sim_snapshot,
    sim_sys_root,
    sim_write_config,
)
from driver.nvml.sim.compute_instances import (
    nvmlComputeInstanceDestroy,
    nvmlComputeInstanceGetInfo,
    nvmlComputeInstanceGetInfo_v2,
    nvmlDeviceGetComputeInstanceId,
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    nvmlDeviceGetGpuInstanceId,
    nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMigDeviceHandleByIndex,
    nvmlDeviceIsMigDeviceHandle,
    nvmlGpuInstanceCreateComputeInstance,
    nvmlGpuInstanceGetComputeInstanceById,
    nvmlGpuInstanceGetComputeInstanceProfileInfo,
    nvmlGpuInstanceGetComputeInstanceProfileInfoV,
    nvmlGpuInstanceGetComputeInstanceRemainingCapacity,
    nvmlGpuInstanceGetComputeInstances,
)
from driver.nvml.sim.config import SimConfig, SimConfigError
from driver.nvml.sim.devices import (
    nvmlDeviceGetAddressingMode,
    nvmlDeviceGetArchitecture,
    nvmlDeviceGetBrand,
    nvmlDeviceGetCount,
    nvmlDeviceGetCudaComputeCapability,
    nvmlDeviceGetHandleByIndex,
    nvmlDeviceGetHandleByUUID,
    nvmlDeviceGetIndex,
    nvmlDeviceGetMemoryInfo,
    nvmlDeviceGetMigMode,
    nvmlDeviceGetMinorNumber,
    nvmlDeviceGetName,
    nvmlDeviceGetPciInfo,
    nvmlDeviceGetPciInfo_v3,
    nvmlDeviceGetUUID,
    nvmlDeviceSetMigMode,
    nvmlSystemGetCudaDriverVersion,
    nvmlSystemGetCudaDriverVersion_v2,
    nvmlSystemGetDriverVersion,
)
from driver.nvml.sim.faults import (
    sim_clear_faults,
    sim_crash_at,
    sim_hung_calls,
    sim_inject_fault,
    sim_release_hangs,
)
from driver.nvml.sim.gpu_instances import (
    nvmlDeviceCreateGpuInstance,
    nvmlDeviceCreateGpuInstanceWithPlacement,
    nvmlDeviceGetGpuInstanceById,
    nvmlDeviceGetGpuInstancePossiblePlacements,
    nvmlDeviceGetGpuInstancePossiblePlacements_v2,
    nvmlDeviceGetGpuInstanceProfileInfo,
    nvmlDeviceGetGpuInstanceProfileInfoById,
    nvmlDeviceGetGpuInstanceProfileInfoByIdV,
    nvmlDeviceGetGpuInstanceProfileInfoV,
    nvmlDeviceGetGpuInstanceRemainingCapacity,
    nvmlDeviceGetGpuInstances,
    nvmlGpuInstanceDestroy,
    nvmlGpuInstanceGetInfo,
)
from driver.nvml.sim.health import (
    nvmlDeviceGetFieldValues,
    nvmlDeviceGetSupportedEventTypes,
    nvmlDeviceGetTotalEccErrors,
    nvmlDeviceRegisterEvents,
    nvmlEventSetCreate,
    nvmlEventSetFree,
    nvmlEventSetWait,
    nvmlEventSetWait_v2,
    sim_health,
    sim_inject_ecc,
    sim_inject_xid,
)
from driver.nvml.sim.processes import (
    nvmlDeviceGetComputeRunningProcesses,
    nvmlDeviceGetComputeRunningProcesses_v3,
)
from driver.nvml.sim.runtime import (
    configure,
    nvmlInit,
    nvmlInitWithFlags,
    nvmlShutdown,
    sim_config,
)

# Re-export pynvml's constants, error classes and ctypes structs so that code written against
# pynvml finds them here under the same names (NVML_*, NVMLError*, c_nvml*, nvml*_t, versions).
_EXPORT_PREFIXES = ("NVML_", "NVMLError", "c_nvml", "nvmlPciInfo", "nvmlMemory", "struct_c_nvml")
globals().update(
    {k: v for k, v in vars(pynvml).items() if k.startswith(_EXPORT_PREFIXES) and k not in globals()}
)
NVMLError = pynvml.NVMLError
nvmlGpuInstanceProfileInfo_v2 = pynvml.nvmlGpuInstanceProfileInfo_v2
nvmlComputeInstanceProfileInfo_v2 = pynvml.nvmlComputeInstanceProfileInfo_v2
nvmlExceptionClass = pynvml.nvmlExceptionClass

__all__ = [
    "LayoutInstance",
    "NVMLError",
    "SimConfig",
    "SimConfigError",
    "configure",
    "nvmlComputeInstanceDestroy",
    "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceGetAddressingMode",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetBrand",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetGpuInstancePossiblePlacements",
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetGpuInstanceProfileInfoById",
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV",
    "nvmlDeviceGetGpuInstanceProfileInfoV",
    "nvmlDeviceGetGpuInstanceRemainingCapacity",
    "nvmlDeviceGetGpuInstances",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetUUID",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceSetMigMode",
    "nvmlEventSetCreate",
    "nvmlEventSetFree",
    "nvmlEventSetWait",
    "nvmlEventSetWait_v2",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceGetComputeInstanceById",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    "nvmlGpuInstanceGetComputeInstanceRemainingCapacity",
    "nvmlGpuInstanceGetComputeInstances",
    "nvmlGpuInstanceGetInfo",
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlSystemGetDriverVersion",
    "sim_boot_id",
    "sim_boot_layout",
    "sim_clear_faults",
    "sim_config",
    "sim_crash_at",
    "sim_health",
    "sim_hung_calls",
    "sim_inject_ecc",
    "sim_inject_fault",
    "sim_inject_xid",
    "sim_lose_gpu",
    "sim_node_files",
    "sim_proc_root",
    "sim_reboot",
    "sim_release_hangs",
    "sim_reset_gpu",
    "sim_set_busy",
    "sim_set_gpu_clients",
    "sim_set_processes",
    "sim_snapshot",
    "sim_sys_root",
    "sim_write_config",
]

# Fault names are checked against every simulated function, so a typo in a fault is an error
# instead of a fault that never fires.
_cfgmod.KNOWN_OPS = tuple(
    sorted(name[4:] for name in list(globals()) if name.startswith("nvml") and name[4].isupper())
)
