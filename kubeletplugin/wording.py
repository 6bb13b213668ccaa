"""How the node agent names a GPU and a placement in the messages operators and users read."""

from __future__ import annotations

from driver.catalog import Placement
from driver.nvml.types import GpuInfo


def gpu_label(gpu: GpuInfo) -> str:
    """`gpu-0 (NVIDIA A100-SXM4-40GB, GPU-...)`: the device name's prefix, the model, the UUID."""
    return f"gpu-{gpu.minor} ({gpu.product_name}, {gpu.uuid})"


def span(p: Placement) -> str:
    return f"memory slices {p.start}-{p.end - 1}" if p.size > 1 else f"memory slice {p.start}"
