"""What the activation status of a MIG-mode change means (reference: mig-and-nvml.md).

pynvml raises only for the call itself: a refused or pending activation is its return value,
read here against the mode NVML reports afterwards.
"""

from __future__ import annotations

from driver.nvml import errors
from driver.nvml.errors import InstanceInUse, NvmlFailure, ResetRequired
from driver.nvml.types import MigMode

_SUCCESS = 0


def check_activation(status: int, mode: MigMode, enabled: bool, gpu_uuid: str) -> None:
    """Return if the change to ``enabled`` took effect; raise what stands in its way if not."""
    if status == _SUCCESS and mode.current == enabled:
        return
    want = "enable" if enabled else "disable"
    if status == errors.NVML_ERROR_IN_USE:
        raise InstanceInUse(
            f"{gpu_uuid}: cannot {want} MIG mode while MIG instances or other clients "
            "(DCGM, nvidia-persistenced, Xorg) use the GPU; remove them and retry",
            code=status,
            gpu=gpu_uuid,
        )
    if status in (_SUCCESS, errors.NVML_ERROR_RESET_REQUIRED, errors.NVML_ERROR_NOT_SUPPORTED):
        raise ResetRequired(
            f"{gpu_uuid}: MIG mode is now pending {want}d but takes effect only after "
            "a GPU reset (nvidia-smi --gpu-reset -i <index>) or a reboot; drain the GPU "
            "and reset it",
            code=status or None,
            gpu=gpu_uuid,
        )
    raise NvmlFailure(f"{gpu_uuid}: {want} MIG mode was not activated", code=status, gpu=gpu_uuid)


def reset_refusal(
    gpu_uuid: str, name: str, *, enable: bool, pending: bool = False
) -> ResetRequired:
    """Why carve will not change MIG mode on a GPU that applies the change only after a reset
    (Ampere): it never resets a GPU itself, so it says what to run instead."""
    if enable:
        also = " (an enable is already pending)" if pending else ""
        now, change, flag = f"off{also}", "enabling it", "1"
    else:
        now, change, flag = "on", "turning it off", "0"
    return ResetRequired(
        f"{gpu_uuid} ({name}) has MIG mode {now}; on this architecture {change} needs a GPU "
        f"reset, which carve does not do on its own. Run `nvidia-smi -i <index> -mig {flag}` "
        "and reset the GPU or reboot the node",
        gpu=gpu_uuid,
    )
