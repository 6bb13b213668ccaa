"""Typed errors of the NVML layer.

NVML reports failures as bare integer codes whose meaning depends on the call (the same
INSUFFICIENT_RESOURCES means "placement taken" for a create and nothing sensible elsewhere).
The backend translates each code where it knows the context, so that callers can react per
kind (retry elsewhere, report to the user, give up on a GPU) and operators read a message that
says what happened and what to do about it.
"""

# ruff: noqa: N818 -- the names state the condition (PlacementTaken, NotFound); "Error" adds nothing
from __future__ import annotations

# NVML return codes (nvml.h). Numeric here so this module does not depend on the binding.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23

_CODE_NAMES = {
    NVML_ERROR_UNINITIALIZED: "NVML_ERROR_UNINITIALIZED",
    NVML_ERROR_INVALID_ARGUMENT: "NVML_ERROR_INVALID_ARGUMENT",
    NVML_ERROR_NOT_SUPPORTED: "NVML_ERROR_NOT_SUPPORTED",
    NVML_ERROR_NO_PERMISSION: "NVML_ERROR_NO_PERMISSION",
    NVML_ERROR_NOT_FOUND: "NVML_ERROR_NOT_FOUND",
    NVML_ERROR_INSUFFICIENT_SIZE: "NVML_ERROR_INSUFFICIENT_SIZE",
    NVML_ERROR_DRIVER_NOT_LOADED: "NVML_ERROR_DRIVER_NOT_LOADED",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML_ERROR_LIBRARY_NOT_FOUND",
    NVML_ERROR_FUNCTION_NOT_FOUND: "NVML_ERROR_FUNCTION_NOT_FOUND",
    NVML_ERROR_GPU_IS_LOST: "NVML_ERROR_GPU_IS_LOST",
    NVML_ERROR_RESET_REQUIRED: "NVML_ERROR_RESET_REQUIRED",
    NVML_ERROR_IN_USE: "NVML_ERROR_IN_USE",
    NVML_ERROR_INSUFFICIENT_RESOURCES: "NVML_ERROR_INSUFFICIENT_RESOURCES",
}


def nvml_code_name(code: int | None) -> str:
    if code is None:
        return "no NVML code"
    return _CODE_NAMES.get(code, f"NVML error {code}")


class NvmlError(Exception):
    """Base of every NVML-layer error. ``code`` is the NVML return code, if one caused it."""

    def __init__(self, message: str, *, code: int | None = None, gpu: str | None = None) -> None:
        self.code = code
        self.gpu = gpu
        suffix = f" ({nvml_code_name(code)})" if code is not None else ""
        super().__init__(message + suffix)


class NvmlUnavailable(NvmlError):
    """NVML cannot be used at all: library missing, driver not loaded, or not initialised."""


class NotSupported(NvmlError):
    """The GPU or driver cannot do this (no MIG, profile absent, MIG mode off)."""


class MigDisabled(NotSupported):
    """MIG mode is off on the GPU, so instances cannot be created or listed."""


class NoPermission(NvmlError):
    """The process lacks the privilege NVML requires for this call."""


class ResetRequired(NvmlError):
    """A MIG-mode change takes effect only after a GPU reset or reboot."""


class PlacementTaken(NvmlError):
    """The requested placement overlaps an instance, or an engine pool or instance cap is full."""


class InvalidPlacement(NvmlError):
    """NVML does not list this placement for the profile on this GPU."""


class InstanceInUse(NvmlError):
    """An instance (or the GPU, for a MIG-mode change) is held by instances or processes."""


class NotFound(NvmlError):
    """The GPU or instance does not exist."""


class InstanceMismatch(NvmlError):
    """An instance exists under the expected id but is not the one the caller recorded."""


class NvmlFailure(NvmlError):
    """Any other NVML failure; the message names the operation and the code."""


class GpuLost(NvmlError):
    """The GPU has fallen off the bus (XID 79): every call on it fails until a reset or a
    reboot, which bring it back without its MIG instances."""


class GpuUnresponsive(NvmlError):
    """An NVML call on the GPU has not returned within its deadline (a sick GPU often hangs
    rather than fails). Until that call returns, every further call on the GPU fails at once
    with this error instead of queueing behind it; `call` names the one that hangs."""

    def __init__(self, message: str, *, gpu: str | None, call: str, since: float) -> None:
        super().__init__(message, gpu=gpu)
        self.call = call
        self.since = since


class GpuNotPresent(NotFound):
    """No GPU with that UUID on this node (any more): gone after a reboot, or lost at start."""


def from_code(code: int, what: str, *, gpu: str | None = None) -> NvmlError:
    """A typed error for ``code`` when the caller has no more specific reading of it.

    ``what`` is a short description of the attempted operation ("list GPU instances").
    """
    on = f"{gpu}: " if gpu else ""
    if code in (
        NVML_ERROR_UNINITIALIZED,
        NVML_ERROR_LIBRARY_NOT_FOUND,
        NVML_ERROR_DRIVER_NOT_LOADED,
    ):
        return NvmlUnavailable(
            f"{on}cannot {what}: NVML is not usable; check that the NVIDIA driver is loaded and "
            "libnvidia-ml.so.1 is visible to this process",
            code=code,
            gpu=gpu,
        )
    if code == NVML_ERROR_NO_PERMISSION:
        return NoPermission(
            f"{on}cannot {what}: permission denied; run as root or grant read access to "
            "/proc/driver/nvidia/capabilities/mig/config (the plugin needs a privileged pod)",
            code=code,
            gpu=gpu,
        )
    if code == NVML_ERROR_NOT_SUPPORTED:
        return NotSupported(
            f"{on}cannot {what}: not supported by this GPU or driver", code=code, gpu=gpu
        )
    if code == NVML_ERROR_NOT_FOUND:
        return NotFound(f"{on}cannot {what}: no such device or instance", code=code, gpu=gpu)
    if code == NVML_ERROR_IN_USE:
        return InstanceInUse(
            f"{on}cannot {what}: in use by compute instances or processes; stop them first",
            code=code,
            gpu=gpu,
        )
    if code == NVML_ERROR_RESET_REQUIRED:
        return ResetRequired(
            f"{on}cannot {what}: the GPU needs a reset (nvidia-smi --gpu-reset) or a reboot",
            code=code,
            gpu=gpu,
        )
    if code == NVML_ERROR_GPU_IS_LOST:
        return GpuLost(
            f"{on}cannot {what}: the GPU has fallen off the bus; drain the node and check it",
            code=code,
            gpu=gpu,
        )
    return NvmlFailure(f"{on}cannot {what}: NVML call failed", code=code, gpu=gpu)
