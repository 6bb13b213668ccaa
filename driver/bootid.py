"""Which boot of the node this is: the kernel's boot ID.

MIG instances never outlive a reboot (reference §11: GPU and compute instances are never
persisted), but a boot-time agent (nvidia-mig-manager, a systemd unit, an admin) may create
new ones at the same placements before the node agent starts, and NVML may hand out the same
GPU-instance ids again. Only the boot ID tells the node agent for certain that every instance
its checkpoint names is gone. The kernel draws a new random one at every boot and publishes it
at ``/proc/sys/kernel/random/boot_id`` (proc(5)); a container sees the host's, because the
value is not namespaced. NVIDIA's DRA driver keeps it for the same reason
(kubernetes-sigs/dra-driver-nvidia-gpu#1066).

Reading it from a proc root makes it injectable: the simulator keeps a fake /proc whose boot ID
changes with every simulated reboot (``driver.nvml.sim.sim_reboot``).
"""

from __future__ import annotations

import re
from pathlib import Path

BOOT_ID_PATH = "sys/kernel/random/boot_id"

_BOOT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class BootIdError(ValueError):
    """The boot ID file exists but does not hold a boot ID (the message says what it holds)."""


def read_boot_id(proc_root: Path = Path("/proc")) -> str | None:
    """The node's boot ID under `proc_root`; None where the kernel publishes none (no such
    file: not Linux, or a /proc without sysctl files), so that the caller can still work, only
    without telling reboots apart. A file that exists but holds something else is
    BootIdError: a boot ID that is wrong would make the agent see a reboot that did not happen
    (or miss one), so it must not be guessed."""
    path = proc_root / BOOT_ID_PATH
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    value = text.strip().lower()
    if not _BOOT_ID.match(value):
        raise BootIdError(
            f"{path} holds {text[:80]!r}, not a boot ID (a UUID such as "
            "'0f3d7a54-8f7a-4f5e-9d1e-6c1d2b3a4f50'); is the proc root right?"
        )
    return value
