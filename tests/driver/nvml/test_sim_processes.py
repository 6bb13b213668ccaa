"""nvmlDeviceGetComputeRunningProcesses in the simulator, and the backend's use of it.

NVML answers per MIG device for a MIG device handle and for every MIG device of the GPU for the
parent handle; a handle to a destroyed instance is stale (INVALID_ARGUMENT); processes make a
compute-instance destroy IN_USE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.errors import NotFound
from tests.support.nvml import SimFactory, code_of, full_ci, gi_id_of, make_gi

H100 = "H100-SXM5-80GB"


def _mig_handle(nv: Any, dev: Any, gi_id: int) -> Any:
    for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(dev)):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, i)
        except pynvml.NVMLError:
            continue
        if nv.nvmlDeviceGetGpuInstanceId(mig) == gi_id:
            return mig
    raise AssertionError(f"no MIG device for GI {gi_id}")


def test_processes_are_reported_per_mig_device_and_for_the_gpu(make_sim: SimFactory) -> None:
    nv = make_sim([H100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi_a, gi_b = make_gi(nv, dev, 19, 0, 1), make_gi(nv, dev, 19, 1, 1)
    full_ci(nv, gi_a, 1)
    full_ci(nv, gi_b, 1)
    a, b = gi_id_of(nv, gi_a), gi_id_of(nv, gi_b)
    mig_a, mig_b = _mig_handle(nv, dev, a), _mig_handle(nv, dev, b)
    assert nv.nvmlDeviceGetComputeRunningProcesses(mig_a) == []
    nv.sim_set_processes(0, a, 0, [4242, 17])

    procs = nv.nvmlDeviceGetComputeRunningProcesses(mig_a)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (4242, a, 0),
        (17, a, 0),
    ]
    assert procs[0].usedGpuMemory is None  # "not available", as pynvml reports it
    assert nv.nvmlDeviceGetComputeRunningProcesses(mig_b) == []
    assert sorted(p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(dev)) == [17, 4242]
    assert nv.nvmlDeviceGetComputeRunningProcesses_v3(mig_a)[0].pid == 4242


def test_processes_make_destroy_in_use_and_a_stale_handle_is_invalid(make_sim: SimFactory) -> None:
    nv = make_sim([H100])
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    gi = make_gi(nv, dev, 19, 3, 1)
    ci = full_ci(nv, gi, 1)
    gi_id = gi_id_of(nv, gi)
    mig = _mig_handle(nv, dev, gi_id)
    nv.sim_set_processes(0, gi_id, 0, [99])
    assert code_of(nv.nvmlComputeInstanceDestroy, ci) == pynvml.NVML_ERROR_IN_USE
    nv.sim_set_processes(0, gi_id, 0, [])
    nv.nvmlComputeInstanceDestroy(ci)
    assert (
        code_of(nv.nvmlDeviceGetComputeRunningProcesses, mig) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    )


def test_backend_running_processes(make_backend: Callable[..., NvmlBackend]) -> None:
    backend = make_backend([H100])
    gpu = backend.gpus()[0].uuid
    carved = backend.carve(gpu, 19, 2)
    assert backend.running_processes(gpu, carved.mig_uuid) == ()
    sim.sim_set_busy(0, carved.gi_id, carved.ci_id)
    assert len(backend.running_processes(gpu, carved.mig_uuid)) == 1
    sim.sim_set_busy(0, carved.gi_id, carved.ci_id, busy=False)
    backend.destroy(gpu, carved.gi_id)
    with pytest.raises(NotFound):
        backend.running_processes(gpu, carved.mig_uuid)
