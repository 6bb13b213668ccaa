"""What a node publishes per GPU: MIG devices, the whole GPU, or both (issue 11, point 4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.naming import parse_device_name
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.slicereader import parse_resource_slices
from kubeletplugin.nodehardware import NodeHardware
from tests.kubeletplugin.node_harness import sim_config

DRIVER = "mig.carve.dev"
GPUS = [
    "A100-SXM4-40GB",  # Ampere, MIG on: slices only
    {"model": "A100-SXM4-40GB", "mig": False},  # Ampere, MIG off: the whole GPU only
    "H100-SXM5-80GB",  # Hopper: both, MIG mode is turned off for a whole-GPU claim
    {"model": "H100-SXM5-80GB", "mig": False},  # Hopper, MIG off at boot: both too
]


@pytest.fixture
def hw(tmp_path: Path) -> Iterator[NodeHardware]:
    sim.configure(sim_config(tmp_path, GPUS))
    h = NodeHardware(
        NvmlBackend(sim, proc_root=sim.sim_proc_root()).open(), sys_root=sim.sim_sys_root()
    )
    yield h
    h.close()
    sim.configure(None)


def _offers(h: NodeHardware, whole: frozenset[str] = frozenset()) -> list[tuple[bool, bool]]:
    return [(g.offers_mig, g.offers_whole) for g in h.published_gpus(whole=whole)]


def test_each_gpu_offers_what_it_can_hand_out(hw: NodeHardware) -> None:
    assert _offers(hw) == [(True, False), (False, True), (True, True), (True, True)]


def test_a_gpu_held_whole_offers_no_mig_device(hw: NodeHardware) -> None:
    h100 = hw.mig.gpus()[2].uuid
    assert _offers(hw, frozenset({h100})) == [(True, False), (False, True), (False, True),
                                              (True, True)]  # fmt: skip
    slices = hw.resource_slices(
        driver=DRIVER, node_name="n", generation=1, split=True, whole=frozenset({h100})
    )
    names = [d["name"] for s in slices for d in s["spec"].get("devices") or ()]
    assert "gpu-2" in names and not any(
        parse_device_name(n).minor == 2 and parse_device_name(n).is_mig for n in names
    )
    parsed = {g.minor: g for g in parse_resource_slices(slices, DRIVER)}
    assert parsed[0].whole_gpu_device is None and parsed[0].devices
    assert parsed[1].whole_gpu_device == "gpu-1" and not parsed[1].devices
    assert parsed[2].whole_gpu_device == "gpu-2" and not parsed[2].devices


def test_an_ampere_gpu_changes_offer_only_once_its_mig_mode_applies(hw: NodeHardware) -> None:
    ampere = hw.mig.gpus()[1].uuid
    with pytest.raises(Exception, match="pending enabled"):
        hw.mig.set_mig_mode(ampere, True)  # an operator's `nvidia-smi -mig 1`
    assert _offers(hw)[1] == (False, True)  # pending: still MIG off, still whole
    sim.sim_reset_gpu(1)
    assert _offers(hw)[1] == (True, False)


def test_health_lists_the_devices_published_now(hw: NodeHardware) -> None:
    held: set[str] = set()
    source = hw.health_source(DRIVER, "n", dict, dict, whole=lambda: frozenset(held))
    before = {name for _, name, _, _ in source()}
    held.add(hw.mig.gpus()[2].uuid)
    after = {name for _, name, _, _ in source()}
    assert "gpu-2" in after and any(n.startswith("gpu-2-mig") for n in before)
    assert not any(n.startswith("gpu-2-mig") for n in after)


def test_each_gpu_carries_what_nvml_and_sysfs_say_about_it(hw: NodeHardware) -> None:
    """Brand, CUDA version and addressing mode from NVML; root complex and NUMA node from the
    node's sysfs (the simulator's: GPUs in pairs under a root complex); the bus id as the
    standard attribute spells it."""
    gpus = hw.published_gpus()
    assert [(g.brand, g.cuda_driver_version, g.addressing_mode) for g in gpus] == [
        ("Nvidia", "13.0", "HMM")
    ] * 4
    assert [(g.pci_bus_id, g.pcie_root, g.numa_node) for g in gpus] == [
        ("0000:18:00.0", "pci0000:17", 0),
        ("0000:28:00.0", "pci0000:17", 0),
        ("0000:38:00.0", "pci0000:37", 0),
        ("0000:48:00.0", "pci0000:37", 0),
    ]


def test_a_node_without_sysfs_entries_still_publishes_its_gpus(
    hw: NodeHardware, tmp_path: Path
) -> None:
    bare = NodeHardware(hw.mig, hw.proc_root, tmp_path / "no-sys")
    gpus = bare.published_gpus()
    assert len(gpus) == 4 and all(g.pcie_root is None and g.numa_node is None for g in gpus)
    slices = bare.resource_slices(driver=DRIVER, node_name="n", generation=1, split=True)
    attrs = [d["attributes"] for s in slices for d in s["spec"].get("devices") or ()]
    assert attrs and not any("resource.kubernetes.io/pcieRoot" in a for a in attrs)
