"""Simulator administration (sim-only): what an operator or the hardware does to a node.

NVML has nothing like these and the product never calls them: a GPU reset, a node reboot, a
process keeping a compute instance busy, the node's driver root and dev root, and ways for tests
and tools to see and write the simulated node. Faults are injected through ``faults``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import yaml

from driver.catalog import GpuModel, Placement, ProfileSpec
from driver.nvml.sim.config import SimConfig, SimConfigError, parse_config
from driver.nvml.sim.hardware import (
    CI_INDEX_FOR_SIZE,
    CiRec,
    GiRec,
    GpuRec,
    HwState,
    boot_id_of,
    gi_fit_error,
    gi_id_for,
    mig_uuid,
    new_boot_id,
    sync_node_files,
    sync_sys,
)
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


def sim_reboot() -> str:
    """A node reboot: every GPU and compute instance is gone; Ampere applies its pending MIG
    mode (it persists in the InfoROM), Hopper and later come back with MIG disabled (reference
    §11). The kernel's boot ID (``<proc root>/sys/kernel/random/boot_id``) is a new random one,
    which is returned. Nothing runs at boot unless ``sim_boot_layout`` is called next."""

    def body(cfg: SimConfig, state: HwState) -> str:
        for sim_gpu, gpu in zip(cfg.gpus, state.gpus, strict=True):
            _apply_reset(sim_gpu.model, gpu)
        state.boots += 1
        state.boot_id = new_boot_id()
        return state.boot_id

    return admin(body)


def sim_boot_id() -> str:
    """The simulated node's current boot ID, as its fake /proc shows it."""
    return admin(boot_id_of)


@dataclass(frozen=True)
class LayoutInstance:
    """One MIG instance a boot-time layout agent creates: a GPU instance of `profile_id` at
    `placement_start` on GPU `gpu` (its NVML index) with one full-size compute instance."""

    gpu: int
    profile_id: int
    placement_start: int


def sim_boot_layout(instances: Sequence[LayoutInstance]) -> tuple[str, ...]:
    """A boot-time layout agent (nvidia-mig-manager, a systemd unit running ``nvidia-smi mig
    -cgi ... -C``, an admin) lays out MIG instances before the node agent starts: each gets a
    GPU instance at exactly its placement and one full-size compute instance, as NVML creates
    them, so each gets a MIG UUID of its own (a new one, unless the config's option
    ``mig_uuid_stable`` is set). MIG mode is turned on first where it is off and needs no reset
    (Hopper and later); on Ampere with MIG off the agent cannot, and neither can an instance go
    where the GPU's rules refuse it: both are SimConfigError naming the instance, and nothing is
    created. Returns the MIG UUIDs, in the order given."""

    def body(cfg: SimConfig, state: HwState) -> tuple[str, ...]:
        made: list[str] = []
        for n, want in enumerate(instances):
            where = f"layout instance {n} (GPU {want.gpu}, profile {want.profile_id} at "
            where += f"{want.placement_start})"
            if not 0 <= want.gpu < len(state.gpus):
                raise SimConfigError(f"{where}: no such GPU, the node has {len(state.gpus)}")
            gpu, model = state.gpus[want.gpu], cfg.gpus[want.gpu].model
            if gpu.lost or not gpu.mig_capable:
                raise SimConfigError(f"{where}: the GPU is lost or not MIG-capable")
            if gpu.mig_current != pynvml.NVML_DEVICE_MIG_ENABLE:
                if model.architecture.mig_toggle_needs_reset:
                    raise SimConfigError(
                        f"{where}: MIG mode is off and {model.key} applies it only after a "
                        "GPU reset (sim_reset_gpu after setting it)"
                    )
                gpu.mig_current = gpu.mig_pending = pynvml.NVML_DEVICE_MIG_ENABLE
            prof = next((p for p in model.profiles if p.id == want.profile_id), None)
            if prof is None:
                raise SimConfigError(f"{where}: {model.key} has no such profile")
            pl = next((x for x in prof.placements if x.start == want.placement_start), None)
            if pl is None or gi_fit_error(model, gpu, prof, pl) is not None:
                raise SimConfigError(f"{where}: does not fit there on {model.key}")
            made.append(_create_full(cfg, state, gpu, model, prof=prof, pl=pl))
        return tuple(made)

    return admin(body)


def _create_full(
    cfg: SimConfig,
    state: HwState,
    gpu: GpuRec,
    model: GpuModel,
    *,
    prof: ProfileSpec,
    pl: Placement,
) -> str:
    """A GPU instance and its full-size compute instance, as NVML's two create calls make them;
    returns the compute instance's MIG UUID."""
    slices = prof.slices
    ci_profile = CI_INDEX_FOR_SIZE.get(slices)
    if ci_profile is None:
        raise SimConfigError(f"{model.key}: no compute-instance profile of {slices} slices")
    gi = GiRec(gi_id_for(model, gpu.layout, pl), prof.id, pl.start, pl.size, state.next_serial())
    serial = state.next_serial()
    uuid = mig_uuid(cfg, gpu, gi.id, 0, serial)
    gi.cis.append(CiRec(0, ci_profile, 0, slices, serial, uuid))
    gpu.gis.append(gi)
    gpu.gis.sort(key=lambda g: g.id)
    return uuid


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
