"""Per-client MPS limits: the two variables CUDA reads from an MPS client's own environment.

NVIDIA's MPS documents that a client may set ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (an integer
percentage) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (per device, ``<index>=<amount>`` entries
joined by commas, an amount such as ``2G`` or ``512M``) in its environment, and that these only
lower the limits the control daemon sets (``set_default_active_thread_percentage``,
``set_default_device_pinned_mem_limit``): where the daemon's is lower, the daemon's applies.

So in carve the claim's opaque ``mpsConfig`` sets the daemon's defaults, the ceiling for every
client of the claim, and a container that wants less writes these variables in its pod spec.
carve never sets them itself: a CDI environment edit replaces a container's variable of the same
name (seen on the real node: a container's own ``25`` arrived as the claim's ``40``), which would
erase every per-client limit.

Parsed here, in ``driver``, so the controller checks a pod's values with the rules the node
would read them by.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
VARIABLES = (THREAD_PERCENTAGE, PINNED_MEM_LIMIT)

_AMOUNT = re.compile(r"^\s*(\d+)\s*=\s*(\d+)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_FACTORS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class ClientLimitError(ValueError):
    """A client variable CUDA could not read; the message names the variable and the value."""


@dataclass(frozen=True)
class ClientLimits:
    """What one container asks of MPS for itself (None: it leaves the daemon's default)."""

    thread_percentage: int | None = None
    pinned_bytes: Mapping[int, int] | None = None  # CUDA device index (in the client) -> bytes

    @property
    def largest_pinned_bytes(self) -> int | None:
        return max(self.pinned_bytes.values()) if self.pinned_bytes else None

    @property
    def empty(self) -> bool:
        return self.thread_percentage is None and self.pinned_bytes is None


def parse_thread_percentage(value: str) -> int:
    text = value.strip()
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise ClientLimitError(f"{THREAD_PERCENTAGE}={value!r}: must be an integer from 1 to 100")
    return int(text)


def parse_pinned_limit(value: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for part in value.split(","):
        m = _AMOUNT.match(part)
        if m is None:
            raise ClientLimitError(
                f"{PINNED_MEM_LIMIT}={value!r}: {part.strip()!r} is not <device index>=<amount> "
                "such as 0=2G or 0=512M"
            )
        index, amount = int(m.group(1)), int(m.group(2)) * _FACTORS[m.group(3).upper()]
        if index in out:
            raise ClientLimitError(f"{PINNED_MEM_LIMIT}={value!r}: device {index} given twice")
        if amount == 0:
            raise ClientLimitError(f"{PINNED_MEM_LIMIT}={value!r}: device {index} limit is 0")
        out[index] = amount
    return out


def parse_client_env(env: Mapping[str, str]) -> ClientLimits:
    """The limits in a container's literal environment; ClientLimitError for a bad value."""
    pct = env.get(THREAD_PERCENTAGE)
    pinned = env.get(PINNED_MEM_LIMIT)
    return ClientLimits(
        thread_percentage=None if pct is None else parse_thread_percentage(pct),
        pinned_bytes=None if pinned is None else parse_pinned_limit(pinned),
    )
