"""Calling the NVML simulator as code written for pynvml does (tests/driver/nvml/): the error
code a call fails with, a GPU instance at a placement, its id, a compute instance over all
its slices; and the type of the `make_sim` fixture (tests/driver/nvml/conftest.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

# make_sim(gpus, **top_level) -> the sim module, configured and initialised.
SimFactory = Callable[..., Any]


def code_of(fn: Any, *args: Any) -> int:
    with pytest.raises(pynvml.NVMLError) as info:
        fn(*args)
    return int(info.value.value)


def make_gi(nv: Any, dev: Any, profile_id: int, start: int, size: int) -> Any:
    pl = pynvml.c_nvmlGpuInstancePlacement_t()
    pl.start, pl.size = start, size
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile_id, ctypes.byref(pl))


def gi_id_of(nv: Any, gi: Any) -> int:
    return int(nv.nvmlGpuInstanceGetInfo(gi).id)


def full_ci(nv: Any, gi: Any, slices: int) -> Any:
    index = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices]
    info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
    return nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
