"""The simulator's health API: XID/ECC events through pynvml's event-set calls, the GPU
recovery-action field, ECC counters, injection at run time and in the config."""

from __future__ import annotations

import multiprocessing
import time

import pynvml
import pytest

from driver.nvml import sim
from driver.nvml.sim.config import SimConfigError
from tests.support.nvml import SimFactory

H100 = "H100-SXM5-80GB"
A100 = "A100-SXM4-40GB"
EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)
RECOVERY = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


def _timeout(nv: object, event_set: object, ms: int = 50) -> int:
    with pytest.raises(pynvml.NVMLError) as err:
        sim.nvmlEventSetWait_v2(event_set, ms)
    return int(err.value.value)


def _action(nv: object, index: int) -> int:
    dev = sim.nvmlDeviceGetHandleByIndex(index)
    (value,) = sim.nvmlDeviceGetFieldValues(dev, [RECOVERY])
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    return int(value.value.uiVal)


def test_an_event_set_gets_the_events_of_its_gpus_after_it_registered(make_sim: SimFactory) -> None:
    nv = make_sim([H100, A100])
    sim.sim_inject_xid(1, 31)  # before the set exists: never delivered, as in NVML
    es = nv.nvmlEventSetCreate()
    dev = nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetSupportedEventTypes(dev) & EVENTS == EVENTS
    nv.nvmlDeviceRegisterEvents(dev, EVENTS, es)
    assert _timeout(nv, es) == pynvml.NVML_ERROR_TIMEOUT
    sim.sim_inject_xid(0, 74)  # another GPU: not for this set
    sim.sim_inject_xid(1, 74)  # (XID 79 would take the GPU off the bus: test_sim.py)
    sim.sim_inject_ecc(1, uncorrected=False)
    first = nv.nvmlEventSetWait_v2(es, 1000)
    assert nv.nvmlDeviceGetUUID(first.device) == nv.nvmlDeviceGetUUID(dev)
    assert (first.eventType, first.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 74)
    second = nv.nvmlEventSetWait_v2(es, 1000)
    assert second.eventType == pynvml.nvmlEventTypeSingleBitEccError
    assert _timeout(nv, es) == pynvml.NVML_ERROR_TIMEOUT
    nv.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError) as err:
        nv.nvmlEventSetWait_v2(es, 10)
    assert err.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT


def _inject_later(config: dict[str, object]) -> None:
    sim.configure(config)
    time.sleep(0.3)
    sim.sim_inject_xid(0, 48)


def test_an_event_raised_by_another_process_wakes_a_waiter(make_sim: SimFactory) -> None:
    nv = make_sim([H100])
    config = {"state": str(nv.sim_config().state_path), "gpus": [H100]}
    es = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(0), EVENTS, es)
    other = multiprocessing.get_context("spawn").Process(target=_inject_later, args=(config,))
    other.start()
    data = nv.nvmlEventSetWait_v2(es, 10_000)
    other.join(10)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 48)


def test_the_driver_asks_for_a_reset_after_a_fatal_xid_until_one_happens(
    make_sim: SimFactory,
) -> None:
    nv = make_sim([H100, H100])
    assert _action(nv, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    sim.sim_inject_xid(0, 13)  # an application's fault: no recovery needed
    assert _action(nv, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    sim.sim_inject_xid(0, 74)  # an NVLink error: the GPU answers, and asks for a reset
    assert _action(nv, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    sim.sim_inject_ecc(1, uncorrected=True)
    dev1 = nv.nvmlDeviceGetHandleByIndex(1)
    volatile, uncorrected = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    assert nv.nvmlDeviceGetTotalEccErrors(dev1, uncorrected, volatile) == 1
    assert _action(nv, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    (other,) = nv.nvmlDeviceGetFieldValues(dev1, [pynvml.NVML_FI_DEV_RESET_STATUS])
    assert other.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    sim.sim_reset_gpu(0)
    sim.sim_reset_gpu(1)
    assert _action(nv, 0) == _action(nv, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert nv.nvmlDeviceGetTotalEccErrors(dev1, uncorrected, volatile) == 0  # counts restart


def test_without_event_support_registration_is_refused(make_sim: SimFactory) -> None:
    nv = make_sim([A100], options={"health_events": False})
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetSupportedEventTypes(dev) == 0
    es = nv.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError) as err:
        nv.nvmlDeviceRegisterEvents(dev, pynvml.nvmlEventTypeXidCriticalError, es)
    assert err.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    sim.sim_inject_xid(0, 74)
    assert _action(nv, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET  # pollable still


def test_a_gpu_can_boot_sick_and_bad_values_are_named(make_sim: SimFactory) -> None:
    nv = make_sim([{"model": H100, "recovery_action": "gpu-reset"}, H100])
    assert _action(nv, 0) == pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    assert _action(nv, 1) == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    with pytest.raises(SimConfigError, match=r"gpus\[0\].recovery_action must be one of"):
        make_sim([{"model": H100, "recovery_action": "reboot-please"}])
    with pytest.raises(SimConfigError, match="no GPU 5"):
        sim.sim_inject_xid(5, 79)
