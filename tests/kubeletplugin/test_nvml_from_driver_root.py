"""Outside --simulate, NVML is the driver root's library, loaded before pynvml looks for it by
name (the plugin's container has no driver of its own)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

from driver.driverroot import DriverRootError
from kubeletplugin import nodehardware

VERSION = "580.105.08"


def test_the_driver_roots_nvml_is_loaded_first(tmp_path: Path, monkeypatch: Any) -> None:
    lib = tmp_path / "usr/lib/x86_64-linux-gnu" / f"libnvidia-ml.so.{VERSION}"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    loaded: list[tuple[str, int]] = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: loaded.append((path, mode)))
    nodehardware._load_nvml_from(tmp_path)
    assert loaded == [(str(lib), ctypes.RTLD_GLOBAL)]


def test_a_driver_root_without_nvml_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(DriverRootError, match=r"--driver-root .*: no libnvidia-ml.so.<version>"):
        nodehardware._load_nvml_from(tmp_path)
