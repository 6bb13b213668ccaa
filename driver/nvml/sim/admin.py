"""Simulator administration (sim-only): what an operator or the hardware does to a node.

NVML has nothing like these and the product never calls them: a GPU reset, a node reboot, a
process keeping a compute instance busy, the node's driver root and dev root, and ways for tests
and tools to see and write the simulated node. Faults are injected through ``faults``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml
import yaml

from driver.catalog import GpuModel
from driver.nvml.sim.config import SimConfig, SimConfigError, parse_config
from driver.nvml.sim.hardware import GpuRec, HwState, sync_node_files, sync_sys
from driver.nvml.sim.runtime import admin, raise_nvml, sim_config


def sim_reset_gpu(index: int) -> None:
    """A GPU reset (``nvidia-smi --gpu-reset``): applies a pending MIG mode on Ampere; Hopper
    and later lose MIG mode. Refused with IN_USE while GPU instances or processes exist, as
    the driver refuses to reset a busy GPU, unless the GPU is lost: then its instances and
    clients are gone already, and the reset brings it back empty."""

    def body(cfg: SimConfig, state: HwState) -> None:
        gpu = state.gpus[index]
        if (gpu.gis or gpu.clients) and not gpu.lost:
            raise_nvml(pynvml.NVML_ERROR_IN_USE)
        _apply_reset(cfg.gpus[index].model, gpu)

    admin(body)


def sim_lose_gpu(index: int) -> None:
    """The GPU falls off the bus without an XID being reported first: every NVML call on it
    answers GPU_IS_LOST until ``sim_reset_gpu`` or ``sim_reboot``."""

    def body(cfg: SimConfig, state: HwState) -> None:
        if not 0 <= index < len(state.gpus):
            raise SimConfigError(f"no GPU {index}: the node has {len(state.gpus)}")
        state.gpus[index].lost = True

    admin(body)


def _apply_reset(model: GpuModel, gpu: GpuRec) -> None:
    gpu.lost = False
    gpu.gis = []
    gpu.clients = 0
    gpu.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE  # what a reset recovers from
    gpu.ecc_corrected = gpu.ecc_uncorrected = 0  # volatile counts restart
    if model.architecture.mig_toggle_needs_reset:
        gpu.mig_current = gpu.mig_pending  # persisted in the InfoROM
    else:
        gpu.mig_current = gpu.mig_pending = pynvml.NVML_DEVICE_MIG_DISABLE


def sim_reboot() -> None:
    """A node reboot: every GPU and compute instance is gone; Ampere applies its pending MIG
    mode (it persists), Hopper and later come back with MIG disabled."""

    def body(cfg: SimConfig, state: HwState) -> None:
        for sim_gpu, gpu in zip(cfg.gpus, state.gpus, strict=True):
            _apply_reset(sim_gpu.model, gpu)
        state.boots += 1

    admin(body)


def sim_set_busy(gpu: int, gi_id: int, ci_id: int, busy: bool = True) -> None:
    """Pretend a process runs on a compute instance, so destroying it gives IN_USE (and the
    process query names the calling process)."""
    sim_set_processes(gpu, gi_id, ci_id, [os.getpid()] if busy else [])


def sim_set_processes(gpu: int, gi_id: int, ci_id: int, pids: list[int]) -> None:
    """The host PIDs running on a compute instance (empty: none), as
    nvmlDeviceGetComputeRunningProcesses reports them; any makes a destroy IN_USE."""

    def body(cfg: SimConfig, state: HwState) -> None:
        gi = state.gpus[gpu].gi(gi_id)
        ci = None if gi is None else next((c for c in gi.cis if c.id == ci_id), None)
        if ci is None:
            raise SimConfigError(f"no compute instance {gpu}/{gi_id}/{ci_id}")
        ci.busy = False
        ci.pids = [int(p) for p in pids]

    admin(body)


def sim_set_gpu_clients(index: int, clients: int) -> None:
    """Pretend ``clients`` processes hold the whole GPU (a workload on a whole-GPU device,
    DCGM, nvidia-persistenced): MIG-mode changes then get activationStatus IN_USE and a GPU
    reset is refused. 0 lets them go. A reboot ends every process."""
    if clients < 0:
        raise SimConfigError(f"clients must be >= 0, got {clients}")

    def body(cfg: SimConfig, state: HwState) -> None:
        if not 0 <= index < len(state.gpus):
            raise SimConfigError(f"no GPU {index}: the node has {len(state.gpus)}")
        state.gpus[index].clients = clients

    admin(body)


def sim_snapshot() -> dict[str, Any]:
    """The simulated hardware as plain data (GPUs with their GIs and CIs, pending faults)."""
    return admin(lambda cfg, state: state.to_json())


def sim_proc_root() -> Path:
    """Root of the fake /proc tree (``devices``, ``driver/nvidia-caps/mig-minors``,
    ``driver/nvidia/capabilities/...``). Created on first use of the state."""
    cfg = sim_config()
    admin(lambda c, s: None)
    return cfg.effective_proc_root


def sim_sys_root() -> Path:
    """Root of the fake /sys tree: ``bus/pci/devices/<address>`` links into ``devices/`` and
    each GPU's ``numa_node``, where a node agent finds the PCIe root complex and NUMA node of
    a GPU (driver.pcie). Created on first use; the topology never changes."""
    cfg = sim_config()
    admin(sync_sys)
    return cfg.effective_sys_root


def sim_node_files(
    driver_root: str | os.PathLike[str] | None, dev_root: str | os.PathLike[str] | None
) -> None:
    """Give the simulated node its own driver root and dev root, and fill them (idempotently).

    The driver root gets placeholder libraries of the simulated driver version, firmware and the
    ``nvidia-smi`` stand-in; the dev root the NVIDIA device nodes (as root only). Both are kept
    in step with the state from then on, by whichever process changes it, because the roots are
    recorded in the state file. None leaves that part out (and stops keeping it up to date).
    """

    def body(cfg: SimConfig, state: HwState) -> None:
        roots = {}
        if driver_root is not None:
            roots["driver_root"] = str(Path(driver_root).absolute())
        if dev_root is not None:
            roots["dev_root"] = str(Path(dev_root).absolute())
        state.node_roots = roots
        sync_node_files(cfg, state, provision=True)

    admin(body)


def sim_write_config(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write a config file (YAML) after validating it; returns the path."""
    p = Path(path)
    parse_config(data, p.resolve().parent)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(dict(data), sort_keys=False))
    return p
