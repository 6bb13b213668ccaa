"""The NVIDIA device nodes a container needs, and where their numbers come from.

A container gets a GPU through /dev/nvidia<minor> and /dev/nvidiactl, and exactly one MIG slice
of it through two nvidia-caps capability nodes: the access files of its GPU instance and of its
compute instance. Those minors follow a fixed table in the driver, but the nvidia-caps and
nvidia-uvm majors are assigned when the kernel module loads and must be read from
/proc/devices. None of this is NVML (NVML neither creates nor reports these nodes), so it lives
here, beside the CDI specs that hand the nodes to the container runtime, and the NVML backend
and ``driver.cdi`` both take it from here.
"""

from __future__ import annotations

from pathlib import Path

from driver.nvml.errors import NvmlFailure
from driver.nvml.types import CapDevice

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
NVIDIACTL_PATH = "/dev/nvidiactl"
NVIDIA_UVM_PATH = "/dev/nvidia-uvm"
NVIDIA_UVM_TOOLS_PATH = "/dev/nvidia-uvm-tools"
NVIDIA_CAPS_DEVICE_DIR = "/dev/nvidia-caps"


def gpu_device_path(gpu_minor: int) -> str:
    """The node of the whole GPU with device minor ``gpu_minor``."""
    return f"/dev/nvidia{gpu_minor}"


def cap_device_path(cap_minor: int) -> str:
    """The nvidia-caps node with minor ``cap_minor``."""
    return f"{NVIDIA_CAPS_DEVICE_DIR}/nvidia-cap{cap_minor}"


def gi_cap_minor(gpu_minor: int, gi_id: int) -> int:
    """nvidia-caps minor of ``gpu<gpu_minor>/gi<gi_id>/access`` (RM nv-caps.c table order)."""
    return 3 + 135 * gpu_minor + 9 * gi_id


def ci_cap_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """nvidia-caps minor of ``gpu<gpu_minor>/gi<gi_id>/ci<ci_id>/access``."""
    return 4 + 135 * gpu_minor + 9 * gi_id + ci_id


def cap_minors(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """(GI access minor, CI access minor) under /dev/nvidia-caps."""
    return gi_cap_minor(gpu_minor, gi_id), ci_cap_minor(gpu_minor, gi_id, ci_id)


def parse_char_major(proc_devices: str, name: str) -> int | None:
    """The major number ``name`` has in the "Character devices" part of /proc/devices."""
    in_char = False
    for line in proc_devices.splitlines():
        stripped = line.strip()
        if stripped.endswith(":"):
            in_char = stripped == "Character devices:"
            continue
        parts = stripped.split()
        if in_char and len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


def caps_major(proc_root: Path) -> int:
    """The dynamic major of the nvidia-caps character devices, from <proc_root>/devices.

    Raises NvmlFailure when the file is unreadable or lists no nvidia-caps: the backend's own
    failure type, so callers that handle the backend's errors handle this one too.
    """
    path = proc_root / "devices"
    try:
        text = path.read_text()
    except OSError as exc:
        raise NvmlFailure(
            f"cannot read {path} to find the nvidia-caps major ({exc.strerror}); mount the "
            "host's /proc or set the proc root"
        ) from exc
    major = parse_char_major(text, "nvidia-caps")
    if major is None:
        raise NvmlFailure(
            f"{path} lists no nvidia-caps device; is the NVIDIA driver (with MIG support) loaded?"
        )
    return major


def cap_devices(
    proc_root: Path, gpu_minor: int, gi_id: int, ci_id: int
) -> tuple[CapDevice, CapDevice]:
    """The GI and CI access nodes of one MIG device, with the major read from /proc."""
    major = caps_major(proc_root)
    gi_minor, ci_minor = cap_minors(gpu_minor, gi_id, ci_id)
    return (
        CapDevice(cap_device_path(gi_minor), major, gi_minor),
        CapDevice(cap_device_path(ci_minor), major, ci_minor),
    )
