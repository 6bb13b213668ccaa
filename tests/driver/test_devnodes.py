"""Device-node numbers and paths: the nvidia-caps minor table and /proc/devices parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.devnodes import (
    cap_device_path,
    cap_devices,
    cap_minors,
    caps_major,
    ci_cap_minor,
    gi_cap_minor,
    gpu_device_path,
    parse_char_major,
)
from driver.nvml.errors import NvmlFailure

PROC_DEVICES = (
    "Character devices:\n195 nvidia\n511 nvidia-caps\n\nBlock devices:\n511 nvidia-caps-b\n"
)


def test_caps_minors_match_the_reference_cross_checks() -> None:
    assert ci_cap_minor(3, 3, 3) == 439  # DRA nvcaps.go
    assert ci_cap_minor(6, 11, 7) == 920
    assert (gi_cap_minor(0, 7), ci_cap_minor(0, 7, 0)) == (66, 67)  # GB200 capture
    assert gi_cap_minor(2, 2) == 291  # H100 Slurm host
    assert [gi_cap_minor(2, i) for i in (7, 8, 9)] == [336, 345, 354]
    assert cap_minors(0, 7, 0) == (66, 67)


def test_char_major_is_read_from_the_character_devices_only() -> None:
    assert parse_char_major(PROC_DEVICES, "nvidia-caps") == 511
    assert parse_char_major("Block devices:\n 12 nvidia-caps\n", "nvidia-caps") is None


def test_cap_devices_carry_paths_and_the_proc_major(tmp_path: Path) -> None:
    (tmp_path / "devices").write_text(PROC_DEVICES)
    gi_dev, ci_dev = cap_devices(tmp_path, 0, 7, 0)
    assert (gi_dev.path, gi_dev.major, gi_dev.minor) == ("/dev/nvidia-caps/nvidia-cap66", 511, 66)
    assert (ci_dev.path, ci_dev.major, ci_dev.minor) == ("/dev/nvidia-caps/nvidia-cap67", 511, 67)
    assert (gpu_device_path(3), cap_device_path(439)) == (
        "/dev/nvidia3",
        "/dev/nvidia-caps/nvidia-cap439",
    )


def test_caps_major_explains_a_missing_driver(tmp_path: Path) -> None:
    with pytest.raises(NvmlFailure, match="cannot read"):
        caps_major(tmp_path / "nowhere")
    (tmp_path / "devices").write_text("Character devices:\n195 nvidia\n")
    with pytest.raises(NvmlFailure, match="lists no nvidia-caps"):
        caps_major(tmp_path)
