"""The simulator's reboot and boot-time layout agent (driver.nvml.sim.sim_reboot and
sim_boot_layout): what the node agent sees through NVML and /proc after a node reboots."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.bootid import BootIdError, read_boot_id
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.sim import LayoutInstance, SimConfigError

H100_1G, H100_3G = 19, 9


@pytest.fixture
def backend(tmp_path: Path) -> NvmlBackend:
    sim.configure(
        {
            "state": str(tmp_path / "state.json"),
            "gpus": ["H100-SXM5-80GB", {"model": "A100-SXM4-40GB"}],
        }
    )
    return NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()


def test_a_reboot_takes_every_instance_and_brings_a_new_boot_id(backend: NvmlBackend) -> None:
    h100, a100 = (g.uuid for g in backend.gpus())
    before = backend.boot_id()
    assert before is not None and before == sim.sim_boot_id()
    assert backend.boot_id() == before  # stable within a boot
    backend.carve(h100, H100_1G, 3)
    backend.carve(a100, 19, 0)

    after = sim.sim_reboot()

    assert after != before and backend.boot_id() == after == sim.sim_boot_id()
    assert (sim.sim_proc_root() / "sys/kernel/random/boot_id").read_text() == after + "\n"
    # MIG mode as the architecture persists it: Hopper loses it, Ampere keeps it (InfoROM)
    assert not backend.mig_enabled(h100) and backend.mig_enabled(a100)
    assert backend.instances(a100) == ()


def test_a_boot_time_agent_recreates_instances_with_new_mig_uuids(backend: NvmlBackend) -> None:
    h100 = backend.gpus()[0].uuid
    old = backend.carve(h100, H100_1G, 3)
    sim.sim_reboot()

    (made,) = sim.sim_boot_layout([LayoutInstance(0, H100_1G, 3)])

    assert backend.mig_enabled(h100)  # the agent turned MIG mode on (no reset on Hopper)
    (inst,) = backend.instances(h100)
    # the same placement gives the same GI id, but it is another instance: another MIG UUID
    assert (inst.gi_id, inst.profile_id, inst.placement.start) == (old.gi_id, H100_1G, 3)
    assert inst.mig_uuid == made and made != old.mig_uuid
    assert len(inst.compute_instances) == 1  # the full-size CI, as `nvidia-smi mig -cgi -C`


def test_a_layout_that_does_not_fit_is_refused_whole(backend: NvmlBackend) -> None:
    h100 = backend.gpus()[0].uuid
    with pytest.raises(SimConfigError, match=r"layout instance 1 .*does not fit"):
        sim.sim_boot_layout([LayoutInstance(0, H100_3G, 0), LayoutInstance(0, H100_1G, 0)])
    assert backend.instances(h100) == ()  # nothing half made
    with pytest.raises(SimConfigError, match="no such GPU"):
        sim.sim_boot_layout([LayoutInstance(5, H100_1G, 0)])


def test_a_boot_id_file_that_holds_something_else_is_an_error(tmp_path: Path) -> None:
    assert read_boot_id(tmp_path) is None  # no such file: unknown, not an error
    f = tmp_path / "sys/kernel/random/boot_id"
    f.parent.mkdir(parents=True)
    f.write_text("not-a-boot-id\n")
    with pytest.raises(BootIdError, match="not a boot ID"):
        read_boot_id(tmp_path)
    f.write_text("0F3D7A54-8F7A-4F5E-9D1E-6C1D2B3A4F50\n")
    assert read_boot_id(tmp_path) == "0f3d7a54-8f7a-4f5e-9d1e-6c1d2b3a4f50"
