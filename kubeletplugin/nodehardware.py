"""The node's GPUs as the agent uses them: the NVML backend plus what to publish.

One place decides between the real NVML (`pynvml` from nvidia-ml-py) and the simulator
(`driver.nvml.sim`, selected by `--simulate CONFIG`); everything downstream is the same code.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.apiviews import SliceView
from driver.cdi import DeviceNode, uvm_device_nodes
from driver.devnodes import parse_char_major
from driver.driverroot import LIBRARY_DIRS, DriverRootError, nvml_library
from driver.naming import DevicePlace, parse_device_name
from driver.nvml.backend import NvmlBackend
from driver.nvml.errors import NvmlError
from driver.pcie import read_topology, standard_bus_id
from driver.resourceslice import PublishedGpu, build_resource_slices

_log = logging.getLogger(__name__)


@dataclass
class NodeHardware:
    mig: NvmlBackend
    proc_root: Path = Path("/proc")
    # Where the GPUs' PCIe root complex and NUMA node are read (driver.pcie): the node's /sys,
    # which a container sees as the host's, or the simulator's fake tree.
    sys_root: Path = Path("/sys")
    # GPU UUID -> (offers MIG devices, offers itself) as last published: a GPU that falls off
    # the bus, hangs or fails cannot say, and keeps what it offered, tainted.
    _offers: dict[str, tuple[bool, bool]] = field(default_factory=dict)

    def common_device_nodes(self) -> tuple[DeviceNode, ...]:
        """Nodes every container with a carve device needs besides the per-device ones.

        /dev/nvidia-uvm has a dynamic major; without the module loaded (no CUDA yet on the
        host) there is nothing to add and CUDA would load it inside the container's view.
        """
        try:
            text = (self.proc_root / "devices").read_text()
        except OSError:
            return ()
        major = parse_char_major(text, "nvidia-uvm")
        return () if major is None else uvm_device_nodes(uvm_major=major)

    def published_gpus(
        self,
        exclude: Collection[str] = (),
        whole: Collection[str] = (),
        taints: Mapping[str, tuple[Mapping[str, str], ...]] | None = None,
        device_taints: Mapping[str, Mapping[DevicePlace, tuple[Mapping[str, str], ...]]]
        | None = None,
        whole_taints: Mapping[str, tuple[Mapping[str, str], ...]] | None = None,
    ) -> list[PublishedGpu]:
        """MIG-capable GPUs of the node, minus refused ones (by UUID), each with what it offers.

        A whole GPU must not be in MIG mode. Hopper and later turn MIG mode off for a whole-GPU
        claim and back on after it, so they offer both kinds, except that a GPU held whole
        (`whole`, by UUID) offers no MIG device until it is released. Ampere changes MIG mode
        only with a GPU reset, which carve never does: it offers MIG devices while MIG mode is
        on and the whole GPU only while it is off (a pending change counts once it applies).
        `taints` (by UUID) go on every device of the GPU (an unhealthy GPU's), `device_taints`
        (by UUID, then (profile id, placement start)) on single MIG devices, `whole_taints`
        (by UUID) on the whole-GPU device alone.
        """
        taints = taints or {}
        device_taints = device_taints or {}
        whole_taints = whole_taints or {}
        out: list[PublishedGpu] = []
        for g in self.mig.gpus():
            if g.uuid in exclude or not g.mig_capable or not g.profiles:
                continue
            if g.mig_toggle_needs_reset:
                try:
                    mig_on = self.mig.mig_mode(g.uuid).current
                except NvmlError:  # lost, hung or failing: it keeps what it offered
                    mig_on = self._offers.get(g.uuid, (True, False))[0]
                offers_mig, offers_whole = mig_on, not mig_on
            else:
                offers_mig, offers_whole = g.uuid not in whole, True
            self._offers[g.uuid] = (offers_mig, offers_whole)
            bus_id = standard_bus_id(g.pci_bus_id)
            topology = read_topology(self.sys_root, bus_id)
            out.append(
                PublishedGpu(
                    minor=g.minor,
                    uuid=g.uuid,
                    model=self.mig.gpu_model(g.uuid),
                    pci_bus_id=bus_id,
                    driver_version=g.driver_version,
                    offers_mig=offers_mig,
                    offers_whole=offers_whole,
                    taints=tuple(taints.get(g.uuid, ())),
                    device_taints=dict(device_taints.get(g.uuid, {})),
                    whole_taints=tuple(whole_taints.get(g.uuid, ())),
                    brand=g.brand,
                    cuda_driver_version=g.cuda_driver_version,
                    addressing_mode=g.addressing_mode,
                    pcie_root=topology.pcie_root,
                    numa_node=topology.numa_node,
                )
            )
        return out

    def resource_slices(
        self,
        *,
        driver: str,
        node_name: str,
        generation: int,
        split: bool,
        exclude: Collection[str] = (),
        whole: Collection[str] = (),
        taints: Mapping[str, tuple[Mapping[str, str], ...]] | None = None,
        device_taints: Mapping[str, Mapping[DevicePlace, tuple[Mapping[str, str], ...]]]
        | None = None,
        whole_taints: Mapping[str, tuple[Mapping[str, str], ...]] | None = None,
        binding_conditions: tuple[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        return build_resource_slices(
            driver=driver,
            node_name=node_name,
            pool_generation=generation,
            gpus=self.published_gpus(exclude, whole, taints, device_taints, whole_taints),
            split_counters=split,
            binding_conditions=binding_conditions,
        )

    def health_source(
        self,
        driver: str,
        node_name: str,
        refused: Callable[[], Mapping[str, str]],
        mps_down: Callable[[], Mapping[str, str]] = dict,
        *,
        whole: Callable[[], Collection[str]] = frozenset,
        sick: Callable[[], Mapping[str, str]] = dict,
        sick_devices: Callable[[], Mapping[str, Mapping[DevicePlace, str]]] = dict,
    ) -> Callable[[], list[tuple[str, str, bool, str]]]:
        """Device health for the kubelet: every published device healthy, except those of a
        GPU the agent refuses (foreign instances under policy refuse-gpu, `refused` by GPU
        UUID), those of a GPU found unhealthy (XID or ECC errors, `sick` by GPU UUID), single
        MIG devices of an instance that had an error (`sick_devices`) and those
        whose claim's MPS control daemon is down (`mps_down` by device name), with the reasons.
        The devices are those published now (`whole`: GPUs held whole)."""
        minors = {g.uuid: g.minor for g in self.mig.gpus()}

        def source() -> list[tuple[str, str, bool, str]]:
            bad: dict[int, str] = {}
            for u, why in [*refused().items(), *sick().items()]:
                if u in minors:
                    bad[minors[u]] = f"{bad[minors[u]]}; {why}" if minors[u] in bad else why
            down = mps_down()
            by_minor = {minors[u]: places for u, places in sick_devices().items() if u in minors}
            slices = [
                SliceView(s)
                for s in self.resource_slices(
                    driver=driver, node_name=node_name, generation=0, split=True, whole=whole()
                )
            ]
            devices = [(s.pool_name, d["name"]) for s in slices for d in s.devices]
            out = []
            for pool, name in devices:
                parsed = parse_device_name(name)
                own = None
                if parsed.profile_id is not None and parsed.placement_start is not None:
                    place = (parsed.profile_id, parsed.placement_start)
                    own = by_minor.get(parsed.minor, {}).get(place)
                whys = [w for w in (bad.get(parsed.minor), own, down.get(name)) if w]
                out.append((pool, name, not whys, "; ".join(whys)))
            return out

        return source

    def close(self) -> None:
        self.mig.close()


def open_backend(
    simulate: Path | None, driver_root: Path = Path("/"), *, timeout: float | None = None
) -> NodeHardware:
    """Open NVML, or the simulator configured by the file `simulate`, with ``timeout`` as the
    deadline of every GPU operation (driver.nvml.deadline; None: none).

    With a driver root other than ``/`` (the GPU Operator's ``/run/nvidia/driver``, or the
    host's root mounted into the plugin's container), NVML is the driver root's own
    ``libnvidia-ml.so.<version>``, loaded first so that pynvml's load by name finds it."""
    if simulate is not None:
        from driver.nvml import sim

        os.environ["CARVE_SIM_CONFIG"] = str(simulate)
        sim.configure(simulate)
        proc = sim.sim_proc_root()
        backend = NvmlBackend(sim, proc_root=proc, timeout=timeout)
        return NodeHardware(backend.open(), proc, sim.sim_sys_root())
    import pynvml

    if driver_root != Path("/"):
        _load_nvml_from(driver_root)
    return NodeHardware(NvmlBackend(pynvml, timeout=timeout).open())


def _load_nvml_from(driver_root: Path) -> None:
    library = nvml_library(driver_root)
    if library is None:
        raise DriverRootError(
            f"--driver-root {driver_root}: no libnvidia-ml.so.<version> in any of "
            f"{', '.join(LIBRARY_DIRS)} under it; point --driver-root at the NVIDIA driver's "
            "files (/ for a host install, /run/nvidia/driver with the GPU Operator)"
        )
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _log.info("NVML from the driver root: %s", library)
