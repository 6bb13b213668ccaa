"""Where a GPU sits on the PCI bus, in the form Kubernetes' standard attributes want.

Two standard device attributes (domain ``resource.kubernetes.io``) say where a device is:
``pciBusID``, the device's address, and ``pcieRoot``, the PCIe root complex above it. Drivers
of different devices that publish the same values let one claim align them: a GPU and a NIC
under one root complex via ``matchAttribute: resource.kubernetes.io/pcieRoot``. That only works
if every driver derives the values the same way, so carve follows the definition in
``k8s.io/dynamic-resource-allocation/deviceattribute`` (``pci_linux.go``, v0.36; the helper
NVIDIA's DRA driver calls):

* **pciBusID** is the extended BDF form ``dddd:bb:dd.f`` in lower-case hex with a four-digit
  domain (the helper refuses anything else). NVML prints an eight-digit, upper-case domain
  (``00000000:3B:00.0``); NVIDIA's driver lower-cases it and drops four leading zeros
  (go-nvlib ``GetPCIBusID``), and so does :func:`standard_bus_id`.
* **pcieRoot** comes from sysfs. ``/sys/bus/pci/devices/<bus id>`` is a symbolic link into
  ``/sys/devices``, whose directories nest the way the hardware does:
  ``/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0``. The helper reads that link (one
  ``readlink``, not a full resolution), joins a relative target to the link's directory
  (``/sys/bus/pci/devices``) and cleans the path, requires the result to start with
  ``/sys/devices/pci`` and to end in the bus id itself, and takes the first path element under
  ``/sys/devices``: ``pci0000:3a``, i.e. ``pci<domain>:<root bus>``. Any failure means no
  attribute (NVIDIA's driver logs it and publishes the device without one).
* **numaNode** (``resource.kubernetes.io/numaNode``, an int) is not defined by that helper;
  NVIDIA's driver takes it from ``/sys/bus/pci/devices/<bus id>/numa_node`` (go-nvlib nvpci)
  and leaves it out when the kernel reports ``-1`` (no NUMA affinity). carve does the same.

The rules are pure functions of strings here; :func:`read_topology` is the only part that
touches a file system, and takes the sysfs root as an argument so that the NVML simulator's
fake ``/sys`` (``driver.nvml.sim.sim_sys_root``) stands in for the node's.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PcieTopology",
    "numa_node_from_text",
    "pcie_root_from_link",
    "read_topology",
    "standard_bus_id",
]

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]")
_NVML_DOMAIN_PADDING = re.compile(r"0{4}[0-9a-f]{4}:")
_BUS_DEVICES = "/sys/bus/pci/devices"
_DEVICES = "/sys/devices"


@dataclass(frozen=True)
class PcieTopology:
    """What sysfs says about one PCI device; None where it says nothing usable."""

    pcie_root: str | None = None
    numa_node: int | None = None


def standard_bus_id(bus_id: str) -> str:
    """NVML's bus id (``00000000:3B:00.0``) in the standard attribute's form (``0000:3b:00.0``).

    Raises ValueError for a value that is not a PCI address even then: the apiserver would
    accept it, but no other driver would ever publish a matching one.
    """
    text = bus_id.strip().lower()
    if _NVML_DOMAIN_PADDING.match(text):
        text = text[4:]
    if not _BDF.fullmatch(text):
        raise ValueError(
            f"PCI bus id {bus_id!r} is not an extended BDF address (dddd:bb:dd.f in hex)"
        )
    return text


def pcie_root_from_link(bus_id: str, link_target: str) -> str | None:
    """The root complex (``pci0000:3a``) from the target of ``/sys/bus/pci/devices/<bus_id>``.

    ``bus_id`` is in the standard form. None when the target is not what the Kubernetes helper
    accepts: outside ``/sys/devices/pci*``, or not ending in the device's own address. The
    paths are the node's: under another sysfs root (the simulator's tree, a host's /sys
    mounted elsewhere) the link's text is the same, so it is judged as if under /sys.
    """
    target = link_target
    if not posixpath.isabs(target):
        target = posixpath.normpath(posixpath.join(_BUS_DEVICES, target))
    if not target.startswith(_DEVICES + "/pci") or posixpath.basename(target) != bus_id:
        return None
    return target.removeprefix(_DEVICES + "/").split("/", 1)[0]


def numa_node_from_text(text: str) -> int | None:
    """The NUMA node in a sysfs ``numa_node`` file; None for ``-1`` (none) or junk."""
    try:
        node = int(text.strip())
    except ValueError:
        return None
    return node if node >= 0 else None


def read_topology(sys_root: Path, bus_id: str) -> PcieTopology:
    """Root complex and NUMA node of the device at standard ``bus_id``, from the sysfs tree at
    ``sys_root`` (``/sys`` on a node). Never raises: what cannot be read is left out, as
    NVIDIA's driver leaves it out, and the device is still published."""
    device = sys_root / "bus" / "pci" / "devices" / bus_id
    try:
        target = os.readlink(device)
    except OSError:
        return PcieTopology()
    try:
        numa_text = (device / "numa_node").read_text()
    except OSError:
        numa_text = ""
    return PcieTopology(pcie_root_from_link(bus_id, target), numa_node_from_text(numa_text))
