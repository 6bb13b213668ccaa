"""The NVML backend on the simulator: discovery, carving, listing, destroying, typed errors."""

from __future__ import annotations

import ctypes
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from driver.catalog import Architecture, Placement, gpu_model
from driver.devnodes import parse_char_major
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.errors import (
    GpuLost,
    InstanceInUse,
    InstanceMismatch,
    InvalidPlacement,
    MigDisabled,
    NoPermission,
    NotFound,
    NotSupported,
    NvmlFailure,
    NvmlUnavailable,
    PlacementTaken,
    ResetRequired,
)
from driver.nvml.types import MigMode

MakeBackend = Callable[..., NvmlBackend]
A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
RTX = "RTX-PRO-6000-Blackwell"


def test_enumerates_gpus_with_device_facts(make_backend: MakeBackend) -> None:
    b = make_backend([A100, {"model": H100, "minor": 5}])
    a, h = b.gpus()
    assert (a.index, a.minor, a.name, a.architecture) == (
        0,
        0,
        "NVIDIA A100-SXM4-40GB",
        Architecture.AMPERE,
    )
    assert (h.minor, h.architecture, h.cuda_compute_capability) == (5, Architecture.HOPPER, (9, 0))
    assert a.pci_device_id == 0x20B0 and a.pci_bus_id.startswith("00000000:")
    assert a.memory_mib == gpu_model(A100).memory_mib
    assert a.driver_version == "580.105.08"
    assert a.mig_capable and a.mig_toggle_needs_reset and not h.mig_toggle_needs_reset
    assert b.gpu(h.uuid) is h


def test_reads_brand_cuda_version_and_addressing_mode_as_nvidias_driver_names_them(
    make_backend: MakeBackend,
) -> None:
    a, h = make_backend([A100, H100]).gpus()
    assert (a.brand, a.cuda_driver_version, a.addressing_mode) == ("Nvidia", "13.0", "HMM")
    assert (h.brand, h.cuda_driver_version, h.addressing_mode) == ("Nvidia", "13.0", "HMM")
    (g,) = make_backend(
        [A100], options={"brand": "TESLA", "cuda_driver_version": 12080, "addressing_mode": "ATS"}
    ).gpus()
    assert (g.brand, g.cuda_driver_version, g.addressing_mode) == ("Tesla", "12.8", "ATS")
    (g,) = make_backend([A100], options={"addressing_mode": "none"}).gpus()
    assert g.addressing_mode == "None"  # supported by the platform, not active


@pytest.mark.parametrize("brand", ["NVIDIA_VGAMEDEV", "NVIDIA_NPU"])
def test_a_brand_nvidias_driver_cannot_name_reads_unknown(
    make_backend: MakeBackend, brand: str
) -> None:
    (g,) = make_backend([A100], options={"brand": brand}).gpus()
    assert g.brand == "Unknown"


def test_no_addressing_mode_where_nvml_cannot_tell(make_backend: MakeBackend) -> None:
    """NOT_SUPPORTED (the platform) and FUNCTION_NOT_FOUND (an older driver's library) leave it
    unknown, as go-nvlib does; the GPU is still described."""
    (g,) = make_backend([A100], options={"addressing_mode": "unsupported"}).gpus()
    assert g.addressing_mode is None and g.profiles
    missing = [{"op": "DeviceGetAddressingMode", "error": "FUNCTION_NOT_FOUND"}]
    (g,) = make_backend([A100], faults=missing).gpus()
    assert g.addressing_mode is None and g.brand == "Nvidia"


def test_no_addressing_mode_with_a_binding_that_lacks_the_call(
    make_sim: Callable[..., object],
) -> None:
    """A binding without the function: an nvidia-ml-py older than the call."""
    nv = make_sim([A100])
    older = types.SimpleNamespace(
        **{k: v for k, v in vars(nv).items() if k != "nvmlDeviceGetAddressingMode"}
    )
    with NvmlBackend(older) as b:
        (g,) = b.gpus()
    assert g.addressing_mode is None and g.brand == "Nvidia"


@pytest.mark.parametrize(
    ("error", "said"),
    [
        ("UNKNOWN", "read the addressing mode: NVML call failed (NVML error 999)"),
        ("TIMEOUT", "read the addressing mode: NVML call failed (NVML error 10)"),
        ("RESET_REQUIRED", "needs a reset"),
        ("GPU_IS_LOST", "fallen off the bus"),
    ],
)
def test_any_error_while_describing_a_gpu_leaves_out_that_gpu_only(
    make_backend: MakeBackend, error: str, said: str
) -> None:
    """Issue 45, point 2: whatever NVML answers for one GPU at start-up, the node's other GPUs
    are enumerated and the failing one is reported with the reason (it used to raise, and the
    agent exited, taking every healthy GPU with it)."""
    failing = [{"op": "DeviceGetAddressingMode", "error": error, "gpu": 0}]
    b = make_backend([A100, A100], faults=failing)
    assert [g.index for g in b.gpus()] == [1]
    assert set(b.unusable()) == {0} and said in b.unusable()[0].why, b.unusable()
    assert [g.index for g in b.gpus()] == [0, 1] and b.unusable() == {}  # it answers again


@pytest.mark.parametrize("key", [A100, H100, RTX, "A30-24GB", "B200-180GB"])
def test_discovered_model_matches_the_catalog_geometry(make_backend: MakeBackend, key: str) -> None:
    """Discovery rebuilds, from NVML calls alone, the facts the simulator was given."""
    b = make_backend([key])
    uuid = b.gpus()[0].uuid
    found = b.gpu_model(uuid)
    expected = gpu_model(key)
    assert (found.memory_units, found.compute_slices) == (
        expected.memory_units,
        expected.compute_slices,
    )
    assert found.architecture is expected.architecture

    def facts(m: object) -> set[tuple[object, ...]]:
        return {
            (
                p.index,
                p.id,
                p.slices,
                p.memory_mib,
                p.multiprocessors,
                p.engines,
                p.max_instances,
                p.placements,
            )
            for p in m.profiles  # type: ignore[attr-defined]
        }

    assert facts(found) == facts(expected)
    assert all(p.evidence == "VERIFIED" for p in found.profiles)
    assert {p.name for p in found.profiles} == {p.name for p in expected.profiles}


def test_carve_list_and_destroy(make_backend: MakeBackend) -> None:
    b = make_backend([A100])
    uuid = b.gpus()[0].uuid
    carved = b.carve(uuid, 9, 4)
    assert carved.placement == Placement(4, 4) and carved.ci_id == 0 and carved.gpu_minor == 0
    assert carved.mig_uuid.startswith("MIG-")
    (inst,) = b.instances(uuid)
    assert (inst.gi_id, inst.profile_id, inst.placement, inst.ci_ids) == (
        carved.gi_id,
        9,
        Placement(4, 4),
        (0,),
    )
    assert inst.mig_uuid == carved.mig_uuid
    assert inst.compute_instances[0].slices == 3
    assert b.remaining_capacity(uuid, 9) == 1
    b.destroy(uuid, carved.gi_id)
    assert b.instances(uuid) == ()
    b.destroy(uuid, carved.gi_id)  # idempotent
    assert sim.sim_snapshot()["gpus"][0]["gis"] == []


def test_gi_ids_come_from_nvml_not_from_placements(make_backend: MakeBackend) -> None:
    b = make_backend(
        [{"model": A100, "gi_id_layout": "identity"}, {"model": A100, "gi_id_layout": "half-swap"}]
    )
    ids = [b.carve(g.uuid, 9, 4).gi_id for g in b.gpus()]
    assert ids == [2, 1]


def test_carve_errors_are_typed_and_say_what_to_do(make_backend: MakeBackend) -> None:
    b = make_backend([A100])
    uuid = b.gpus()[0].uuid
    b.carve(uuid, 9, 4)
    with pytest.raises(PlacementTaken, match="choose another placement") as taken:
        b.carve(uuid, 14, 4)
    assert taken.value.code == 23 and taken.value.gpu == uuid
    with pytest.raises(InvalidPlacement, match="valid starts are 0, 4"):
        b.carve(uuid, 9, 2)
    with pytest.raises(NotSupported, match="no MIG profile with id 77"):
        b.carve(uuid, 77, 0)
    with pytest.raises(NotFound):
        b.carve("GPU-nope", 9, 0)
    b.carve(uuid, 20, 0)  # 1g+me takes the OFA
    with pytest.raises(PlacementTaken):
        b.carve(uuid, 20, 1)


def test_failed_compute_instance_rolls_back_the_gpu_instance(make_backend: MakeBackend) -> None:
    b = make_backend([A100])
    uuid = b.gpus()[0].uuid
    sim.sim_inject_fault("GpuInstanceCreateComputeInstance", error="INSUFFICIENT_RESOURCES")
    with pytest.raises(NvmlFailure) as failure:
        b.carve(uuid, 19, 3)
    assert failure.value.code == 23
    assert b.instances(uuid) == ()


def test_ensure_compute_instance_finishes_a_half_carved_instance(make_backend: MakeBackend) -> None:
    b = make_backend([H100])
    uuid = b.gpus()[0].uuid
    dev = sim.nvmlDeviceGetHandleByIndex(0)
    pl = sim.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = 2, 2
    gi = sim.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 14, ctypes.byref(pl))
    gi_id = sim.nvmlGpuInstanceGetInfo(gi).id
    (half,) = b.instances(uuid)
    assert half.ci_ids == () and half.mig_uuid is None
    done = b.ensure_compute_instance(uuid, gi_id)
    assert (done.gi_id, done.profile_id, done.placement) == (gi_id, 14, Placement(2, 2))
    again = b.ensure_compute_instance(uuid, gi_id)
    assert again == done
    with pytest.raises(NotFound):
        b.ensure_compute_instance(uuid, 14)


def test_destroy_guards_against_a_reused_gi_id(make_backend: MakeBackend) -> None:
    b = make_backend([A100])
    uuid = b.gpus()[0].uuid
    carved = b.carve(uuid, 19, 6)
    with pytest.raises(InstanceMismatch, match="left untouched"):
        b.destroy(uuid, carved.gi_id, expect_profile_id=20)
    assert len(b.instances(uuid)) == 1
    b.destroy(uuid, carved.gi_id, expect_profile_id=19, expect_placement=Placement(6, 1))
    assert b.instances(uuid) == ()


def test_destroy_refuses_while_processes_run(make_backend: MakeBackend) -> None:
    b = make_backend([A100])
    uuid = b.gpus()[0].uuid
    carved = b.carve(uuid, 14, 0)
    sim.sim_set_busy(0, carved.gi_id, carved.ci_id)
    with pytest.raises(InstanceInUse, match="still has processes"):
        b.destroy(uuid, carved.gi_id)
    sim.sim_set_busy(0, carved.gi_id, carved.ci_id, busy=False)
    b.destroy(uuid, carved.gi_id)
    assert b.instances(uuid) == ()


def test_mig_mode_on_hopper_is_enabled_on_demand(make_backend: MakeBackend) -> None:
    b = make_backend([{"model": H100, "mig": False}])
    uuid = b.gpus()[0].uuid
    assert not b.mig_enabled(uuid)
    assert b.instances(uuid) == ()
    with pytest.raises(MigDisabled, match="MIG mode is off"):
        b.carve(uuid, 19, 0)
    assert b.enable_mig(uuid).current
    b.carve(uuid, 19, 0)
    with pytest.raises(InstanceInUse, match="cannot disable MIG mode"):
        b.set_mig_mode(uuid, False)


def test_mig_mode_on_ampere_is_refused_with_a_reset_hint(make_backend: MakeBackend) -> None:
    b = make_backend([{"model": A100, "mig": False}])
    uuid = b.gpus()[0].uuid
    with pytest.raises(ResetRequired, match="needs a GPU reset"):
        b.enable_mig(uuid)
    assert not b.mig_mode(uuid).pending  # enable_mig changed nothing
    with pytest.raises(ResetRequired, match="pending enabled"):
        b.set_mig_mode(uuid, True)
    assert b.mig_mode(uuid).change_pending
    sim.sim_reset_gpu(0)
    assert b.enable_mig(uuid).current


def test_mig_mode_off_for_a_whole_gpu_on_hopper(make_backend: MakeBackend) -> None:
    b = make_backend([H100])
    uuid = b.gpus()[0].uuid
    carved = b.carve(uuid, 19, 0)
    with pytest.raises(InstanceInUse, match="cannot disable MIG mode while MIG instances"):
        b.disable_mig(uuid)
    assert b.mig_enabled(uuid)
    b.destroy(uuid, carved.gi_id)
    sim.sim_set_gpu_clients(0, 1)
    with pytest.raises(InstanceInUse, match="other clients"):
        b.disable_mig(uuid)
    sim.sim_set_gpu_clients(0, 0)
    assert b.disable_mig(uuid) == MigMode(current=False, pending=False)
    assert b.disable_mig(uuid) == MigMode(current=False, pending=False)  # idempotent
    assert b.enable_mig(uuid).current
    b.carve(uuid, 19, 0)  # MIG works again after the round trip


def test_mig_mode_off_on_ampere_is_refused_with_a_reset_hint(make_backend: MakeBackend) -> None:
    b = make_backend([A100, {"model": A100, "mig": False}])
    on, off = (g.uuid for g in b.gpus())
    with pytest.raises(ResetRequired, match=r"turning it off needs a GPU reset.*-mig 0"):
        b.disable_mig(on)
    assert b.mig_mode(on) == MigMode(current=True, pending=True)  # nothing left pending
    assert b.disable_mig(off) == MigMode(current=False, pending=False)


def test_missing_privileges_become_no_permission(make_sim: Callable[..., object]) -> None:
    nv = make_sim([A100], options={"privileged": False})
    with NvmlBackend(nv) as b, pytest.raises(NoPermission, match="privileged"):
        b.gpus()


def test_no_simulator_configured_is_nvml_unavailable(make_sim: Callable[..., object]) -> None:
    make_sim([A100])
    sim.configure(None)
    with pytest.raises(NvmlUnavailable, match="NVIDIA driver"):
        NvmlBackend(sim).open()


def test_caps_major_from_proc_devices(make_backend: MakeBackend, tmp_path: Path) -> None:
    b = make_backend([A100])
    gi_dev, ci_dev = b.cap_devices(0, 7, 0)
    assert (gi_dev.path, gi_dev.minor, ci_dev.minor) == ("/dev/nvidia-caps/nvidia-cap66", 66, 67)
    assert (
        gi_dev.major
        == b.caps_major()
        == parse_char_major((sim.sim_proc_root() / "devices").read_text(), "nvidia-caps")
    )
    with pytest.raises(NvmlFailure, match="cannot read"):
        NvmlBackend(sim, proc_root=tmp_path / "nowhere").caps_major()


def test_a_lost_gpu_does_not_take_the_others_down(make_backend: MakeBackend) -> None:
    """Issue 32, point 2: a GPU lost before the first enumeration is left out and reported; one
    lost after it keeps its description (its calls fail with GpuLost, so callers isolate it);
    both come back after a reset."""
    b = make_backend([A100, A100, A100])
    first = b.gpus()
    sim.sim_lose_gpu(2)
    assert [g.uuid for g in b.gpus()] == [g.uuid for g in first]  # described before: kept
    assert set(b.unusable()) == {2} and first[2].uuid in b.unusable()[2].why
    with pytest.raises(GpuLost, match="fallen off the bus"):
        b.instances(first[2].uuid)
    assert b.instances(first[0].uuid) == ()

    fresh = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()  # a restarted plugin
    try:
        assert [g.index for g in fresh.gpus()] == [0, 1]  # GPU 2 was never described here
        assert "UUID unknown" in fresh.unusable()[2].why
        sim.sim_reset_gpu(2)
        assert [g.index for g in fresh.gpus()] == [0, 1, 2] and fresh.unusable() == {}
    finally:
        fresh.close()
