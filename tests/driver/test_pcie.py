"""PCI bus ids, PCIe root complexes and NUMA nodes as Kubernetes' standard attributes want them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from driver.pcie import (
    PcieTopology,
    numa_node_from_text,
    pcie_root_from_link,
    read_topology,
    standard_bus_id,
)


@pytest.mark.parametrize(
    ("nvml", "standard"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML: eight-digit domain, upper case
        ("0000:3b:00.0", "0000:3b:00.0"),  # already standard
        ("00000001:C1:1F.7", "0001:c1:1f.7"),  # a second PCI domain keeps its number
        (" 00000000:18:00.0\n", "0000:18:00.0"),
    ],
)
def test_nvml_bus_ids_become_the_standard_form(nvml: str, standard: str) -> None:
    assert standard_bus_id(nvml) == standard


@pytest.mark.parametrize("bad", ["", "18:00.0", "0000:18:00", "00010000:18:00.0", "0000:g8:00.0"])
def test_a_bus_id_that_is_no_pci_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not an extended BDF"):
        standard_bus_id(bad)


@pytest.mark.parametrize(
    ("target", "root"),
    [
        # what the kernel writes: relative to /sys/bus/pci/devices
        ("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", "pci0000:3a"),
        # behind a PCIe switch: the first element under /sys/devices is still the root
        (
            "../../../devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:08.0/0000:3b:00.0",
            "pci0000:00",
        ),
        ("/sys/devices/pci0001:c0/0001:c0:01.0/0000:3b:00.0", "pci0001:c0"),  # absolute
        ("../../../devices/platform/soc/0000:3b:00.0", None),  # not under devices/pci*
        ("../../../devices/pci0000:3a/0000:3a:00.0/0000:3c:00.0", None),  # another device
        ("../../../../devices/pci0000:3a/0000:3b:00.0", None),  # climbs out of /sys
    ],
)
def test_the_root_complex_is_the_first_element_under_sys_devices(
    target: str, root: str | None
) -> None:
    assert pcie_root_from_link("0000:3b:00.0", target) == root


@pytest.mark.parametrize(("text", "node"), [("1\n", 1), ("0", 0), ("-1\n", None), ("x", None)])
def test_numa_node_minus_one_means_none(text: str, node: int | None) -> None:
    assert numa_node_from_text(text) == node


def _device(sys_root: Path, path: str, bus_id: str, numa: str | None) -> None:
    device = sys_root / "devices" / path
    device.mkdir(parents=True)
    if numa is not None:
        (device / "numa_node").write_text(numa)
    links = sys_root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../../devices/{path}", links / bus_id)


def test_read_topology_follows_the_link_in_a_sysfs_tree(tmp_path: Path) -> None:
    _device(tmp_path, "pci0000:3a/0000:3a:00.0/0000:3b:00.0", "0000:3b:00.0", "1\n")
    _device(tmp_path, "pci0000:64/0000:64:01.0/0000:65:00.0", "0000:65:00.0", "-1\n")
    _device(tmp_path, "pci0000:80/0000:80:01.0/0000:81:00.0", "0000:81:00.0", None)
    assert read_topology(tmp_path, "0000:3b:00.0") == PcieTopology("pci0000:3a", 1)
    assert read_topology(tmp_path, "0000:65:00.0") == PcieTopology("pci0000:64", None)
    assert read_topology(tmp_path, "0000:81:00.0") == PcieTopology("pci0000:80", None)
    # no such device (a VM without the GPU's sysfs entry, a container without /sys): nothing
    assert read_topology(tmp_path, "0000:99:00.0") == PcieTopology()
    assert read_topology(tmp_path / "absent", "0000:3b:00.0") == PcieTopology()
