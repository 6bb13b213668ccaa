"""The simulator against the reference (mig-and-nvml.md): shapes, codes and MIG rules, called
exactly as code written for pynvml calls it."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import pynvml
import pytest

from driver.nvml.sim.config import SimConfigError
from tests.support.nvml import SimFactory, code_of, full_ci, gi_id_of, make_gi

A100 = "A100-SXM4-40GB"
H100 = "H100-SXM5-80GB"
A30 = "A30-24GB"
RTX = "RTX-PRO-6000-Blackwell"


def _placements(nv: Any, dev: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(dev, profile_id, None, ctypes.byref(count))
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(dev, profile_id, arr, ctypes.byref(count))
    return [(p.start, p.size) for p in arr]


# --- shapes and enumeration ---------------------------------------------------------------------


def test_uses_pynvml_types_and_error_classes(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(dev, pynvml.c_nvmlDevice_t)
    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    assert info.version == pynvml.nvmlGpuInstanceProfileInfo_v2
    assert (info.id, info.sliceCount, info.memorySizeMB, info.instanceCount) == (19, 1, 4864, 7)
    assert info.name == "MIG 1g.5gb"  # _PrintableStructure decodes char arrays
    v1 = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, 0, 1)
    assert isinstance(v1, pynvml.c_nvmlGpuInstanceProfileInfo_t)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.NVMLError is pynvml.NVMLError
    assert nv.NVML_ERROR_INSUFFICIENT_RESOURCES == 23


def test_calls_before_init_are_uninitialized(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    nv.nvmlShutdown()
    assert code_of(nv.nvmlDeviceGetCount) == pynvml.NVML_ERROR_UNINITIALIZED
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 1


def test_profile_index_enumeration_contract(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    found = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            found[index] = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, index).id
        except pynvml.NVMLError_NotSupported:
            continue
    # reference §2: index -> id on A100
    assert found == {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}
    bad = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    assert code_of(nv.nvmlDeviceGetGpuInstanceProfileInfo, dev, bad) == 2
    assert code_of(nv.nvmlDeviceGetGpuInstanceProfileInfo, dev, 0xA) == 3  # GFX absent on A100


@pytest.mark.parametrize(
    ("model", "profile_id", "expected"),
    [
        (A100, 9, [(0, 4), (4, 4)]),  # 3g.20gb
        (H100, 15, [(0, 2), (2, 2), (4, 2), (6, 2)]),  # 1g.20gb
        (RTX, 14, [(0, 3), (3, 3), (6, 3), (9, 3)]),  # 12 placement units
        (RTX, 0, [(0, 12)]),
        (A30, 14, [(0, 1), (1, 1), (2, 1), (3, 1)]),  # 4 units
        (A30, 0, [(0, 4)]),
    ],
)
def test_possible_placements_match_reference(
    make_sim: SimFactory, model: str, profile_id: int, expected: list[tuple[int, int]]
) -> None:
    nv = make_sim([model])
    assert _placements(nv, nv.nvmlDeviceGetHandleByIndex(0), profile_id) == expected


def test_placements_two_call_protocol_reports_short_buffer(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(1)
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * 1)()
    code = code_of(nv.nvmlDeviceGetGpuInstancePossiblePlacements, dev, 19, arr, ctypes.byref(count))
    assert code == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 7


# --- placement rules ----------------------------------------------------------------------------


def test_overlap_and_unlisted_placements(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    make_gi(nv, dev, 9, 4, 4)
    assert code_of(make_gi, nv, dev, 14, 4, 2) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code_of(make_gi, nv, dev, 9, 2, 4) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code_of(make_gi, nv, dev, 9, 0, 3) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code_of(make_gi, nv, dev, 1234, 0, 1) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_remaining_capacity_after_a_3g_matches_capture(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    cap = nv.nvmlDeviceGetGpuInstanceRemainingCapacity
    assert (cap(dev, 19), cap(dev, 14), cap(dev, 9), cap(dev, 0)) == (7, 3, 2, 1)
    make_gi(nv, dev, 9, 4, 4)
    # reference §5.7: after one A100 3g at 4:4 -> 1g 4/7, 2g 2/3, 3g 1/2
    assert (cap(dev, 19), cap(dev, 14), cap(dev, 9), cap(dev, 0)) == (4, 2, 1, 0)


def test_only_one_plus_me_because_one_ofa(make_sim: SimFactory) -> None:
    nv = make_sim([H100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    make_gi(nv, dev, 20, 0, 1)
    assert code_of(make_gi, nv, dev, 20, 1, 1) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 20) == 0
    make_gi(nv, dev, 19, 1, 1)  # a plain 1g still fits beside it


def test_a30_media_profiles_share_the_single_jpeg(make_sim: SimFactory) -> None:
    nv = make_sim([A30])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    make_gi(nv, dev, 21, 0, 1)  # 1g.6gb+me
    assert code_of(make_gi, nv, dev, 6, 2, 2) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_me_all_admits_only_no_me_profiles(make_sim: SimFactory) -> None:
    nv = make_sim([RTX])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    make_gi(nv, dev, 65, 0, 3)  # 1g.24gb+me.all
    assert code_of(make_gi, nv, dev, 14, 3, 3) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert code_of(make_gi, nv, dev, 47, 3, 3) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    make_gi(nv, dev, 67, 3, 3)  # 1g.24gb-me
    make_gi(nv, dev, 66, 6, 6)  # 2g.48gb-me


def test_me_all_refused_beside_a_media_instance(make_sim: SimFactory) -> None:
    nv = make_sim([RTX])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    make_gi(nv, dev, 14, 0, 3)
    assert code_of(make_gi, nv, dev, 65, 3, 3) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_per_profile_instance_cap(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    for start in (0, 2, 4, 6):
        make_gi(nv, dev, 15, start, 2)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 15) == 0


# --- GI ids and auto placement -------------------------------------------------------------------


def test_gi_ids_are_swizz_ids_under_the_gpu_layout(make_sim: SimFactory) -> None:
    nv = make_sim(
        [{"model": A100, "gi_id_layout": "identity"}, {"model": A100, "gi_id_layout": "half-swap"}]
    )
    ident, swapped = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    # UG-G examples (identity) and an A100 capture (half-swapped), reference §6
    assert gi_id_of(nv, make_gi(nv, ident, 9, 4, 4)) == 2
    assert gi_id_of(nv, make_gi(nv, ident, 14, 2, 2)) == 4
    assert gi_id_of(nv, make_gi(nv, ident, 19, 0, 1)) == 7
    assert gi_id_of(nv, make_gi(nv, swapped, 9, 4, 4)) == 1
    assert gi_id_of(nv, make_gi(nv, swapped, 19, 0, 1)) == 11
    assert gi_id_of(nv, make_gi(nv, swapped, 19, 1, 1)) == 12
    assert gi_id_of(nv, make_gi(nv, swapped, 14, 2, 2)) == 6


def test_auto_placement_reproduces_the_user_guide_failure(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A100, "gi_id_layout": "identity"}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    first = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(dev, 19))
    second = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(dev, 19))
    third = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceCreateGpuInstance(dev, 14))
    assert [(i.id, i.placement.start) for i in (first, second, third)] == [(13, 6), (11, 4), (3, 0)]
    # `-cgi 19,19,14,9`: neither 3g placement is free any more
    assert code_of(nv.nvmlDeviceCreateGpuInstance, dev, 9) == 23


def test_auto_placement_on_a30_counts_up(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A30, "gi_id_layout": "identity"}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    ids = [gi_id_of(nv, nv.nvmlDeviceCreateGpuInstance(dev, 14)) for _ in range(2)]
    assert ids == [3, 4]


# --- compute instances, destroy, handles ---------------------------------------------------------


def test_compute_instance_profiles_per_gi_size(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = make_gi(nv, dev, 0, 0, 8)  # 7g
    sizes = {}
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
        except pynvml.NVMLError_NotSupported:
            continue
        sizes[index] = (info.id, info.sliceCount)
    assert sizes == {0: (0, 1), 1: (1, 2), 2: (2, 3), 3: (3, 4), 4: (4, 7)}
    bad_count = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    assert code_of(nv.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, bad_count, 0) == 2
    assert code_of(nv.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 0, 1) == 2


def test_destroy_order_in_use_not_found_and_stale_handles(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = make_gi(nv, dev, 14, 0, 2)
    ci = full_ci(nv, gi, 2)
    ci_info = nv.nvmlComputeInstanceGetInfo(ci)
    assert ci_info.id == 0
    assert code_of(nv.nvmlGpuInstanceDestroy, gi) == pynvml.NVML_ERROR_IN_USE
    gi_id = gi_id_of(nv, gi)
    assert gi_id_of(nv, nv.nvmlDeviceGetGpuInstanceById(dev, gi_id)) == gi_id
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    assert code_of(nv.nvmlDeviceGetGpuInstanceById, dev, gi_id) == pynvml.NVML_ERROR_NOT_FOUND
    assert code_of(nv.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code_of(nv.nvmlComputeInstanceDestroy, ci) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    # a new instance under the same id does not revive the old handle
    again = make_gi(nv, dev, 14, 0, 2)
    assert gi_id_of(nv, again) == gi_id
    assert code_of(nv.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_busy_compute_instance_cannot_be_destroyed(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = make_gi(nv, dev, 19, 3, 1)
    ci = full_ci(nv, gi, 1)
    nv.sim_set_busy(0, gi_id_of(nv, gi), 0)
    assert code_of(nv.nvmlComputeInstanceDestroy, ci) == pynvml.NVML_ERROR_IN_USE


def test_mig_device_handles_and_uuids(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 7
    assert code_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, dev, 0) == pynvml.NVML_ERROR_NOT_FOUND
    gi_b = make_gi(nv, dev, 14, 4, 2)
    gi_a = make_gi(nv, dev, 19, 0, 1)
    full_ci(nv, gi_a, 1)
    full_ci(nv, gi_b, 2)
    ci_info = nv.nvmlComputeInstanceGetInfo(nv.nvmlGpuInstanceGetComputeInstanceById(gi_a, 0))
    # the compute instance names its parent GPU, not the MIG device
    assert nv.nvmlDeviceIsMigDeviceHandle(ci_info.device).value == 0
    assert nv.nvmlDeviceGetUUID(ci_info.device) == nv.nvmlDeviceGetUUID(dev)
    migs = [nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, i) for i in range(2)]
    assert code_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, dev, 2) == pynvml.NVML_ERROR_NOT_FOUND
    assert code_of(nv.nvmlDeviceGetMigDeviceHandleByIndex, dev, 7) == 2
    pairs = [(nv.nvmlDeviceGetGpuInstanceId(m), nv.nvmlDeviceGetComputeInstanceId(m)) for m in migs]
    assert pairs == sorted(pairs)  # dense, ordered by (GI id, CI id)
    assert {p[0] for p in pairs} == {gi_id_of(nv, gi_a), gi_id_of(nv, gi_b)}
    for m in migs:
        assert nv.nvmlDeviceIsMigDeviceHandle(m).value == 1
        uuid = nv.nvmlDeviceGetUUID(m)
        assert uuid.startswith("MIG-") and len(uuid) == 40
        assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)) == (
            nv.nvmlDeviceGetUUID(dev)
        )
        assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(uuid)) == uuid
    assert code_of(nv.nvmlDeviceGetGpuInstanceId, dev) == pynvml.NVML_ERROR_NOT_SUPPORTED


@pytest.mark.parametrize(("stable", "same"), [(True, True), (False, False)])
def test_mig_uuid_stability_knob(make_sim: SimFactory, stable: bool, same: bool) -> None:
    nv = make_sim([A100], options={"mig_uuid_stable": stable})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    uuids = []
    for _ in range(2):
        gi = make_gi(nv, dev, 19, 0, 1)
        ci = full_ci(nv, gi, 1)
        uuids.append(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, 0)))
        nv.nvmlComputeInstanceDestroy(ci)
        nv.nvmlGpuInstanceDestroy(gi)
    assert (uuids[0] == uuids[1]) is same


def test_placement_passed_by_value_is_a_programming_error(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = 0, 1
    with pytest.raises(TypeError, match="byref"):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, pl)
    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, ctypes.pointer(pl))
    assert gi_id_of(nv, gi) in range(7, 15)


# --- MIG mode and privileges ---------------------------------------------------------------------


def test_ampere_mig_mode_waits_for_a_reset(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A100, "mig": False}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    assert code_of(make_gi, nv, dev, 19, 0, 1) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 0
    status = nv.nvmlDeviceSetMigMode(dev, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
    nv.sim_reset_gpu(0)
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    make_gi(nv, dev, 19, 0, 1)
    status = nv.nvmlDeviceSetMigMode(dev, pynvml.NVML_DEVICE_MIG_DISABLE)
    assert status == pynvml.NVML_ERROR_IN_USE  # refused while instances exist
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    nv.sim_reboot()  # instances are gone; Ampere keeps MIG mode
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19) == 7


def test_ampere_auto_reset_applies_at_once_when_configured(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A100, "mig": False}], options={"ampere_reset": "auto"})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, 1) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]


def test_hopper_toggles_at_once_and_forgets_on_reboot(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": H100, "mig": False}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(dev, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    nv.sim_reboot()
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]


def test_mig_mode_change_is_refused_in_activation_status_while_the_gpu_is_held(
    make_sim: SimFactory,
) -> None:
    """nvml.h: the call succeeds, the activation fails with IN_USE while GPU instances or
    processes hold the GPU; nothing changes, and it works once they are gone."""
    nv = make_sim([H100, {"model": A100, "mig": False}])
    hopper, ampere = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    gi = make_gi(nv, hopper, 19, 0, 1)
    assert nv.nvmlDeviceSetMigMode(hopper, pynvml.NVML_DEVICE_MIG_DISABLE) == (
        pynvml.NVML_ERROR_IN_USE
    )
    assert nv.nvmlDeviceGetMigMode(hopper) == [1, 1]
    nv.nvmlGpuInstanceDestroy(gi)
    nv.sim_set_gpu_clients(0, 2)  # e.g. DCGM and a CUDA process
    assert nv.nvmlDeviceSetMigMode(hopper, pynvml.NVML_DEVICE_MIG_DISABLE) == (
        pynvml.NVML_ERROR_IN_USE
    )
    assert nv.nvmlDeviceGetMigMode(hopper) == [1, 1]
    nv.sim_set_gpu_clients(0, 0)
    assert nv.nvmlDeviceSetMigMode(hopper, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert nv.nvmlDeviceGetMigMode(hopper) == [0, 0]
    # Ampere: a held GPU cannot even get a pending change, nor be reset
    nv.sim_set_gpu_clients(1, 1)
    assert nv.nvmlDeviceSetMigMode(ampere, pynvml.NVML_DEVICE_MIG_ENABLE) == (
        pynvml.NVML_ERROR_IN_USE
    )
    assert nv.nvmlDeviceGetMigMode(ampere) == [0, 0]
    with pytest.raises(pynvml.NVMLError) as err:
        nv.sim_reset_gpu(1)
    assert err.value.value == pynvml.NVML_ERROR_IN_USE
    nv.sim_reboot()  # a reboot ends every process
    assert nv.nvmlDeviceSetMigMode(ampere, pynvml.NVML_DEVICE_MIG_ENABLE) == (
        pynvml.NVML_ERROR_RESET_REQUIRED
    )


def test_mig_mode_change_needs_root_and_a_valid_mode(make_sim: SimFactory) -> None:
    nv = make_sim([H100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError) as err:
        nv.nvmlDeviceSetMigMode(dev, 7)
    assert err.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]


def test_privileges(make_sim: SimFactory) -> None:
    nv = make_sim([H100], options={"privileged": False, "root": False})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, 0).id == 19  # no privilege needed
    assert code_of(_placements, nv, dev, 19) == pynvml.NVML_ERROR_NO_PERMISSION
    assert code_of(make_gi, nv, dev, 19, 0, 1) == pynvml.NVML_ERROR_NO_PERMISSION
    assert code_of(nv.nvmlDeviceSetMigMode, dev, 0) == pynvml.NVML_ERROR_NO_PERMISSION


def test_gpu_without_mig(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": H100, "mig_capable": False, "mig": False}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert code_of(nv.nvmlDeviceGetMigMode, dev) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert code_of(nv.nvmlDeviceGetGpuInstanceProfileInfo, dev, 0) == 3


# --- device data, proc files, config, latency, faults --------------------------------------------


def test_device_description(make_sim: SimFactory) -> None:
    nv = make_sim([A100, H100], uuid_seed="node-a")
    a, h = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetName(a) == "NVIDIA A100-SXM4-40GB"
    assert nv.nvmlDeviceGetArchitecture(a) == pynvml.NVML_DEVICE_ARCH_AMPERE
    assert nv.nvmlDeviceGetArchitecture(h) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nv.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert nv.nvmlDeviceGetMinorNumber(h) == 1
    assert nv.nvmlDeviceGetPciInfo(a).pciDeviceId >> 16 == 0x20B0
    assert nv.nvmlDeviceGetMemoryInfo(a).total == 40960 * 1024 * 1024
    uuids = {nv.nvmlDeviceGetUUID(a), nv.nvmlDeviceGetUUID(h)}
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)


def test_brand_is_nvml_brand_nvidia_unless_configured(make_sim: SimFactory) -> None:
    """nvmlDeviceGetBrand gives an nvmlBrandType_t, on a GPU's handle and its MIG devices'."""
    nv = make_sim([A100, H100])
    a, h = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetBrand(a) == nv.nvmlDeviceGetBrand(h) == pynvml.NVML_BRAND_NVIDIA
    gi = make_gi(nv, a, 19, 0, 1)
    full_ci(nv, gi, 1)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(a, 0)
    assert nv.nvmlDeviceGetBrand(mig) == pynvml.NVML_BRAND_NVIDIA
    assert code_of(nv.nvmlDeviceGetBrand, gi) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # a GI handle
    nv.nvmlShutdown()
    assert code_of(nv.nvmlDeviceGetBrand, a) == pynvml.NVML_ERROR_UNINITIALIZED
    older = make_sim([A100], options={"brand": "TESLA"})
    assert older.nvmlDeviceGetBrand(older.nvmlDeviceGetHandleByIndex(0)) == pynvml.NVML_BRAND_TESLA
    with pytest.raises(SimConfigError, match=r"options\.brand 'ACME'"):
        make_sim([A100], options={"brand": "ACME"})


@pytest.mark.parametrize(
    ("option", "mode"),
    [
        ({}, pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM),
        ({"addressing_mode": "ATS"}, pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS),
        ({"addressing_mode": "none"}, pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE),
    ],
)
def test_addressing_mode_is_the_value_pynvml_returns(
    make_sim: SimFactory, option: dict[str, str], mode: int
) -> None:
    nv = make_sim([H100], options=option or None)
    assert nv.nvmlDeviceGetAddressingMode(nv.nvmlDeviceGetHandleByIndex(0)) == mode


def test_addressing_mode_unsupported_or_missing_gives_nvmls_codes(make_sim: SimFactory) -> None:
    nv = make_sim([A100], options={"addressing_mode": "unsupported"})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert code_of(nv.nvmlDeviceGetAddressingMode, dev) == pynvml.NVML_ERROR_NOT_SUPPORTED
    # a driver without the symbol: pynvml raises FUNCTION_NOT_FOUND before calling anything
    nv = make_sim([A100], faults=[{"op": "DeviceGetAddressingMode", "error": "FUNCTION_NOT_FOUND"}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert code_of(nv.nvmlDeviceGetAddressingMode, dev) == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert nv.nvmlDeviceGetAddressingMode(dev) == pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM
    with pytest.raises(SimConfigError, match=r"options\.addressing_mode must be"):
        make_sim([A100], options={"addressing_mode": "CXL"})


def test_cuda_driver_version_is_nvmls_integer(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    assert nv.nvmlSystemGetCudaDriverVersion() == 13000  # CUDA 13.0, the 580 driver's
    nv.nvmlShutdown()
    assert code_of(nv.nvmlSystemGetCudaDriverVersion) == pynvml.NVML_ERROR_UNINITIALIZED
    nv = make_sim([A100], options={"cuda_driver_version": 12080})
    assert nv.nvmlSystemGetCudaDriverVersion() == 12080


def test_fake_sys_places_gpus_in_pairs_under_root_complexes(make_sim: SimFactory) -> None:
    nv = make_sim([A100] * 5)
    root = nv.sim_sys_root()
    assert nv.sim_sys_root() == root  # idempotent
    seen = {}
    for i in range(5):
        pci = nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByIndex(i))
        nvml_id = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
        address = "0000:" + nvml_id.lower().split(":", 1)[1]  # the kernel's 4-digit domain
        link = root / "bus" / "pci" / "devices" / address
        target = os.readlink(link)
        assert target.startswith("../../../devices/pci0000:") and target.endswith(address)
        assert (link / "numa_node").read_text() == f"{i // 4}\n"  # readable through the link
        seen[i] = target.split("/")[4]
    assert seen[0] == seen[1] == "pci0000:17" and seen[2] == seen[3] == "pci0000:37"
    assert len(set(seen.values())) == 3


def test_fake_proc_tracks_instances(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A100, "minor": 2, "gi_id_layout": "identity"}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    root = nv.sim_proc_root()
    assert "nvidia-caps" in (root / "devices").read_text()
    minors = (root / "driver/nvidia-caps/mig-minors").read_text().splitlines()
    assert minors[-1] == "gpu31/gi14/ci7/access 4322"
    gi = make_gi(nv, dev, 9, 4, 4)
    ci = full_ci(nv, gi, 3)
    caps = root / "driver/nvidia/capabilities/gpu2/mig/gi2"
    assert (caps / "access").read_text().startswith(f"DeviceFileMinor: {3 + 135 * 2 + 9 * 2}\n")
    assert (caps / "ci0/access").exists()
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    assert not caps.exists()


def test_config_errors_name_the_problem(make_sim: SimFactory) -> None:
    with pytest.raises(SimConfigError, match="unknown GPU model 'K80'"):
        make_sim(["K80"])
    with pytest.raises(SimConfigError, match="unknown keys"):
        make_sim([A100], colour="red")
    with pytest.raises(SimConfigError, match="unknown operation"):
        make_sim([A100], faults=["after:MakeCoffee"])


def test_state_file_is_refused_for_other_gpus(make_sim: SimFactory, tmp_path: Any) -> None:
    state = str(tmp_path / "shared.json")
    nv = make_sim([A100], state=state)
    nv.nvmlDeviceGetGpuInstanceRemainingCapacity(nv.nvmlDeviceGetHandleByIndex(0), 19)
    nv = make_sim([H100], state=state)
    with pytest.raises(SimConfigError, match="different set of GPUs"):
        nv.nvmlDeviceGetMigMode(nv.nvmlDeviceGetHandleByIndex(0))


def test_latency_is_applied_per_operation(make_sim: SimFactory) -> None:
    nv = make_sim([A100], options={"latency": {"DeviceCreateGpuInstanceWithPlacement": 0.2}})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    began = time.monotonic()
    make_gi(nv, dev, 19, 0, 1)
    assert time.monotonic() - began >= 0.2


def test_realistic_latency_preset_is_reference_values(make_sim: SimFactory) -> None:
    nv = make_sim([A100], options={"latency": "realistic"})
    cfg = nv.sim_config()
    assert cfg.latency["DeviceCreateGpuInstanceWithPlacement"] == 0.3
    assert cfg.latency["GpuInstanceDestroy"] == 1.0


def test_injected_error_fires_the_given_number_of_times(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.sim_inject_fault("CreateGpuInstanceWithPlacement", error="IN_USE", times=2)
    assert code_of(make_gi, nv, dev, 19, 0, 1) == pynvml.NVML_ERROR_IN_USE
    assert code_of(make_gi, nv, dev, 19, 0, 1) == pynvml.NVML_ERROR_IN_USE
    make_gi(nv, dev, 19, 0, 1)
    assert nv.sim_snapshot()["faults"] == []


def test_after_fault_commits_the_change_but_loses_the_reply(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.sim_inject_fault("CreateGpuInstanceWithPlacement", error=999, when="after")
    assert code_of(make_gi, nv, dev, 19, 0, 1) == pynvml.NVML_ERROR_UNKNOWN
    assert [gi["start"] for gi in nv.sim_snapshot()["gpus"][0]["gis"]] == [0]


def test_fault_tag_limits_the_fault_to_tagged_processes(
    make_sim: SimFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.sim_inject_fault("DeviceGetMigMode", error="GPU_IS_LOST", tag="plugin")
    assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
    monkeypatch.setenv("CARVE_SIM_FAULT_TAG", "plugin")
    assert code_of(nv.nvmlDeviceGetMigMode, dev) == pynvml.NVML_ERROR_GPU_IS_LOST


def test_compute_instance_capacity_inside_a_7g(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = make_gi(nv, dev, 0, 0, 8)
    cap = nv.nvmlGpuInstanceGetComputeInstanceRemainingCapacity
    assert (cap(gi, 0), cap(gi, 2), cap(gi, 4)) == (7, 2, 1)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, 2)  # 3c: compute slices 0-2
    assert (cap(gi, 0), cap(gi, 2), cap(gi, 3), cap(gi, 4)) == (4, 1, 0, 0)
    ids = [nv.nvmlComputeInstanceGetInfo(nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)).id]
    assert ids == [1]  # CI ids count up from 0 within the GPU instance


def test_reset_is_refused_while_instances_exist(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": A100, "mig": False}])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.sim_reset_gpu(0)  # idle: fine, and nothing pending
    assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]
    nv.nvmlDeviceSetMigMode(dev, 1)
    nv.sim_reset_gpu(0)
    make_gi(nv, dev, 19, 0, 1)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.sim_reset_gpu(0)


def test_corrupt_state_file_is_reported_not_guessed(make_sim: SimFactory) -> None:
    nv = make_sim([A100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceGetMigMode(dev)
    nv.sim_config().state_path.write_text("{ half a json")
    with pytest.raises(SimConfigError, match="corrupt"):
        nv.nvmlDeviceGetMigMode(dev)


def test_documented_config_example_is_valid(tmp_path: Any) -> None:
    import yaml

    from driver.nvml.sim import config as cfgmod

    doc = cfgmod.__doc__ or ""
    example = doc.split("is optional)::", 1)[1]
    data = yaml.safe_load("\n".join(line[4:] for line in example.splitlines()))
    cfg = cfgmod.parse_config(data, tmp_path)
    assert [g.model.key for g in cfg.gpus] == [A100, H100]
    assert cfg.gpus[1].minor == 3 and not cfg.gpus[1].mig_enabled
    assert [(f.op, f.action, f.times) for f in cfg.faults] == [
        ("GpuInstanceCreateComputeInstance", "kill", 1),
        ("GpuInstanceDestroy", "error", 2),
    ]


def test_config_can_carry_a_model_the_catalog_lacks(make_sim: SimFactory) -> None:
    from dataclasses import replace

    from driver.catalog import gpu_model
    from driver.nvml.sim.config import model_to_json

    custom = replace(gpu_model(A30), key="LAB-GPU", product_name="Lab GPU 24GB")
    nv = make_sim(["LAB-GPU"], models=[model_to_json(custom)])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetName(dev) == "Lab GPU 24GB"
    assert _placements(nv, dev, 5) == [(0, 2), (2, 2)]


@pytest.mark.parametrize("how", ["xid-79", "lose"])
def test_a_gpu_off_the_bus_answers_gpu_is_lost_until_a_reset(
    make_sim: SimFactory, how: str
) -> None:
    """Issue 32, point 2: as the driver does after XID 79, every call on the lost GPU fails
    with GPU_IS_LOST (before, the simulator stayed kind and health tests passed only because of
    it); the other GPU answers as before; a reset brings it back without its instances."""
    nv = make_sim([A100, A100])
    lost, other = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    uuid = nv.nvmlDeviceGetUUID(lost)
    gi = make_gi(nv, lost, 19, 0, 1)
    full_ci(nv, gi, 1)
    if how == "xid-79":
        nv.sim_inject_xid(0, 79)
    else:
        nv.sim_lose_gpu(0)
    is_lost = pynvml.NVML_ERROR_GPU_IS_LOST
    assert code_of(nv.nvmlDeviceGetUUID, lost) == is_lost
    assert code_of(nv.nvmlDeviceGetMigMode, lost) == is_lost
    assert code_of(nv.nvmlDeviceGetHandleByUUID, uuid) == is_lost
    assert code_of(nv.nvmlGpuInstanceGetInfo, gi) == is_lost
    assert code_of(make_gi, nv, lost, 19, 1, 1) == is_lost
    assert nv.nvmlDeviceGetMigMode(other) == [1, 1]  # the other GPU is untouched
    make_gi(nv, other, 19, 0, 1)
    nv.sim_reset_gpu(0)  # a lost GPU's instances do not hold the reset back
    assert nv.nvmlDeviceGetUUID(lost) == uuid
    count = ctypes.c_uint()
    nv.nvmlDeviceGetGpuInstances(lost, 19, None, ctypes.byref(count))
    assert count.value == 0
