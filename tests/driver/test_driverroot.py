from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver import cdi
from driver.driverroot import (
    BINARIES,
    LIBRARIES,
    LIBRARY_DIRS,
    DriverRootError,
    discover,
    nvml_library,
    resolve_in_root,
)

VERSION = "580.105.08"
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def _file(root: Path, path: str, text: str = "x", mode: int = 0o644) -> Path:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.chmod(mode)
    return p


def _link(root: Path, path: str, target: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, p)


def _driver_tree(root: Path, version: str = VERSION) -> None:
    """A driver as the .run installer or a distribution package lays it out (x86_64 Debian)."""
    for lib in (
        "libnvidia-ml.so",
        "libcuda.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-nvvm.so",
    ):
        _file(root, f"{LIBDIR}/{lib}.{version}")
        _link(root, f"{LIBDIR}/{lib}.1", f"{lib}.{version}")
    _link(root, f"{LIBDIR}/libnvidia-nvvm.so.4", f"libnvidia-nvvm.so.{version}")
    _link(root, f"{LIBDIR}/libcuda.so", "libcuda.so.1")
    # Not ours: graphics and video libraries, an older leftover, an unrelated library.
    _file(root, f"{LIBDIR}/libnvidia-glcore.so.{version}")
    _file(root, f"{LIBDIR}/libnvcuvid.so.{version}")
    _file(root, f"{LIBDIR}/libcuda.so.470.42.01")
    _file(root, f"{LIBDIR}/libc.so.6")
    # 32-bit compat copy in a folder the search does not use.
    _file(root, f"/usr/lib/i386-linux-gnu/libcuda.so.{version}")
    for b in ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control"):
        _file(root, f"/usr/bin/{b}", "#!/bin/sh\n", 0o755)
    _file(root, "/usr/bin/nvidia-settings", "#!/bin/sh\n", 0o755)
    _file(root, "/usr/bin/nvidia-persistenced", "not executable")
    _file(root, f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin")
    _file(root, f"/lib/firmware/nvidia/{version}/gsp_tu10x.bin")
    _file(root, f"/lib/firmware/nvidia/{version}/README")
    _file(root, "/lib/firmware/nvidia/470.42.01/gsp.bin")


def _containers(files: Iterable[cdi.Mount]) -> list[str]:
    return [m.container_path for m in files]


def test_discovery_picks_exactly_the_driver_files(tmp_path: Path) -> None:
    root = tmp_path / "run" / "nvidia" / "driver"
    _driver_tree(root)
    files = discover(root, hook_dirs=())
    assert files.version == VERSION
    assert files.root == root
    assert _containers(files.mounts) == [
        f"{LIBDIR}/libnvidia-ml.so.{VERSION}",
        f"{LIBDIR}/libcuda.so.{VERSION}",
        f"{LIBDIR}/libnvidia-ptxjitcompiler.so.{VERSION}",
        f"{LIBDIR}/libnvidia-nvvm.so.{VERSION}",
        "/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-cuda-mps-control",
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
    ]
    for m in files.mounts:
        assert m.host_path == f"{root}{m.container_path}"
        assert m.options == ("ro", "nosuid", "nodev", "bind")
    assert files.library_dirs == (LIBDIR,)
    assert files.hooks == () and files.hook_binary is None


def test_version_from_nvml_wins_over_the_newest_on_disk(tmp_path: Path) -> None:
    _driver_tree(tmp_path, "550.54.14")
    _driver_tree_extra = tmp_path / LIBDIR.lstrip("/") / f"libnvidia-ml.so.{VERSION}"
    _driver_tree_extra.write_text("x")
    (tmp_path / LIBDIR.lstrip("/") / f"libcuda.so.{VERSION}").write_text("x")
    assert discover(tmp_path, hook_dirs=()).version == VERSION  # the newest
    files = discover(tmp_path, version="550.54.14", hook_dirs=())
    assert f"{LIBDIR}/libcuda.so.550.54.14" in _containers(files.mounts)
    assert f"{LIBDIR}/libcuda.so.{VERSION}" not in _containers(files.mounts)


def test_libraries_behind_links_and_merged_usr(tmp_path: Path) -> None:
    # /lib -> usr/lib (merged /usr), an absolute link inside the root, lib64 on an RPM layout.
    _link(tmp_path, "/lib", "usr/lib")
    _file(tmp_path, f"/usr/lib64/libnvidia-ml.so.{VERSION}")
    _file(tmp_path, f"/usr/lib/x86_64-linux-gnu/real/libcuda.so.{VERSION}")
    _link(
        tmp_path,
        f"/lib/x86_64-linux-gnu/libcuda.so.{VERSION}",
        f"/usr/lib/x86_64-linux-gnu/real/libcuda.so.{VERSION}",
    )
    files = discover(tmp_path, hook_dirs=())
    assert _containers(files.mounts)[:2] == [
        f"/usr/lib64/libnvidia-ml.so.{VERSION}",
        f"/usr/lib/x86_64-linux-gnu/real/libcuda.so.{VERSION}",
    ]
    assert files.library_dirs == ("/usr/lib64", "/usr/lib/x86_64-linux-gnu/real")


def test_resolve_in_root_never_leaves_the_root(tmp_path: Path) -> None:
    _file(tmp_path, "/etc/passwd", "fake")
    _link(tmp_path, "/a/up", "../../../../etc")
    _link(tmp_path, "/a/abs", "/etc/passwd")
    _link(tmp_path, "/loop1", "loop2")
    _link(tmp_path, "/loop2", "loop1")
    assert resolve_in_root(tmp_path, "/a/up/passwd") == "/etc/passwd"
    assert resolve_in_root(tmp_path, "/a/abs") == "/etc/passwd"
    assert resolve_in_root(tmp_path, "/loop1") is None
    assert resolve_in_root(tmp_path, "/missing/x") is None


def test_ipc_sockets_only_when_present() -> None:
    # Unix socket paths are limited to 107 bytes, which pytest's tmp_path can pass (under
    # pytest-xdist, always): a short root of the test's own.
    with tempfile.TemporaryDirectory(prefix="carve-", dir="/tmp") as short:
        _ipc_sockets_only_when_present(Path(short))


def _ipc_sockets_only_when_present(tmp_path: Path) -> None:
    _driver_tree(tmp_path)
    assert not [m for m in discover(tmp_path, hook_dirs=()).mounts if "run" in m.container_path]
    (tmp_path / "run" / "nvidia-persistenced").mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "run" / "nvidia-persistenced" / "socket"))
    try:
        (tmp_path / "tmp" / "nvidia-mps").mkdir(parents=True)
        _link(tmp_path, "/var/run", "../run")
        ipc = [m for m in discover(tmp_path, hook_dirs=()).mounts if "ro" not in m.options]
        assert [(m.container_path, m.options) for m in ipc] == [
            ("/run/nvidia-persistenced/socket", ("nosuid", "nodev", "bind", "noexec")),
            ("/tmp/nvidia-mps", ("nosuid", "nodev", "bind", "noexec")),
        ]
    finally:
        sock.close()


def test_missing_root_and_missing_driver_are_specific(tmp_path: Path) -> None:
    with pytest.raises(DriverRootError, match=r"driver root .*nowhere does not exist"):
        discover(tmp_path / "nowhere", hook_dirs=())
    with pytest.raises(DriverRootError, match=r"no NVIDIA driver under driver root .*libcuda"):
        discover(tmp_path, hook_dirs=())
    _file(tmp_path, f"{LIBDIR}/libcuda.so.{VERSION}")  # libcuda without NVML: unusable
    with pytest.raises(DriverRootError, match=rf"libnvidia-ml.so.{VERSION} is in none of"):
        discover(tmp_path, hook_dirs=())
    _driver_tree(tmp_path / "other")
    with pytest.raises(DriverRootError, match=r"no NVIDIA driver 999.1 under"):
        discover(tmp_path / "other", version="999.1", hook_dirs=())


def _hooks_by_name(files: object) -> dict[str, cdi.Hook]:
    return {h.args[1] if h.args[0] != "nvidia-ctk" else h.args[2]: h for h in files.hooks}  # type: ignore[attr-defined]


def test_hooks_when_the_toolkit_is_installed(tmp_path: Path) -> None:
    root = tmp_path / "driver"
    _driver_tree(root)
    host_bin = tmp_path / "host-bin"
    _file(host_bin, "/nvidia-cdi-hook", "#!/bin/sh\n", 0o755)
    files = discover(root, hook_dirs=[host_bin])
    assert files.hook_binary == str(host_bin / "nvidia-cdi-hook")
    hooks = _hooks_by_name(files)
    assert set(hooks) == {"create-symlinks", "update-ldcache"}
    links = hooks["create-symlinks"]
    assert links.hook_name == "createContainer" and links.path == files.hook_binary
    assert links.args[:2] == ("nvidia-cdi-hook", "create-symlinks")
    pairs = links.args[2:]
    assert pairs[::2] == ("--link",) * (len(pairs) // 2)
    assert set(pairs[1::2]) == {
        f"libnvidia-ml.so.{VERSION}::{LIBDIR}/libnvidia-ml.so.1",
        f"libcuda.so.{VERSION}::{LIBDIR}/libcuda.so.1",
        f"libcuda.so.1::{LIBDIR}/libcuda.so",
        f"libnvidia-ptxjitcompiler.so.{VERSION}::{LIBDIR}/libnvidia-ptxjitcompiler.so.1",
        f"libnvidia-nvvm.so.{VERSION}::{LIBDIR}/libnvidia-nvvm.so.1",
        f"libnvidia-nvvm.so.{VERSION}::{LIBDIR}/libnvidia-nvvm.so.4",
    }
    assert hooks["update-ldcache"].args == ("nvidia-cdi-hook", "update-ldcache", "--folder", LIBDIR)


def test_libcuda_so_link_is_added_when_the_host_lacks_it(tmp_path: Path) -> None:
    _file(tmp_path, f"{LIBDIR}/libnvidia-ml.so.{VERSION}")
    _file(tmp_path, f"{LIBDIR}/libcuda.so.{VERSION}")
    _file(tmp_path, "/usr/bin/nvidia-ctk", "#!/bin/sh\n", 0o755)  # in the driver root
    files = discover(tmp_path, hook_dirs=())
    assert files.hook_binary == str(tmp_path / "usr/bin/nvidia-ctk")
    hooks = _hooks_by_name(files)
    assert hooks["create-symlinks"].args == (
        "nvidia-ctk",
        "hook",
        "create-symlinks",
        "--link",
        f"libcuda.so.1::{LIBDIR}/libcuda.so",
    )
    assert hooks["update-ldcache"].args[:3] == ("nvidia-ctk", "hook", "update-ldcache")


def test_nvidia_cdi_hook_is_preferred_and_must_be_executable(tmp_path: Path) -> None:
    _driver_tree(tmp_path / "root")
    a, b = tmp_path / "a", tmp_path / "b"
    _file(a, "/nvidia-ctk", "#!/bin/sh\n", 0o755)
    _file(b, "/nvidia-cdi-hook", "not executable", 0o644)
    assert discover(tmp_path / "root", hook_dirs=[a, b]).hook_binary == str(a / "nvidia-ctk")
    (b / "nvidia-cdi-hook").chmod(0o755)
    assert discover(tmp_path / "root", hook_dirs=[a, b]).hook_binary == str(b / "nvidia-cdi-hook")


def test_driver_files_make_a_valid_spec(tmp_path: Path) -> None:
    _driver_tree(tmp_path / "root")
    _file(tmp_path, "/bin/nvidia-cdi-hook", "#!/bin/sh\n", 0o755)
    files = discover(tmp_path / "root", hook_dirs=[tmp_path / "bin"])
    node = cdi.DeviceNode("/dev/nvidia0", 195, 0, 0o666)
    w = cdi.CdiWriter(tmp_path / "cdi")
    ids = w.write("claim", [cdi.CdiDevice("gpu-0", (node,))], files.spec_edits())
    spec = cdi.load_spec(w.spec_path("claim"))
    assert spec["cdiVersion"] == "0.3.0"  # mounts and hooks need nothing newer
    edits = cdi.resolve([tmp_path / "cdi"], ids)
    assert [m["containerPath"] for m in edits.mounts] == _containers(files.mounts)
    assert [h["args"][1] for h in edits.hooks] == ["create-symlinks", "update-ldcache"]


# --- property: what discovery picks is what the tree holds, mounted at its in-root path ----------

_names = st.sets(st.sampled_from(LIBRARIES), min_size=0, max_size=6)
_dirs = st.sampled_from(LIBRARY_DIRS[:6])
_versions = st.from_regex(r"[1-9][0-9]{2}\.[0-9]{1,3}(\.[0-9]{2})?", fullmatch=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=_versions,
    libs=_names,
    folder=_dirs,
    bins=st.sets(st.sampled_from(BINARIES)),
    prefix=st.sampled_from(["", "run/nvidia/driver", "host root"]),
)
def test_discovered_mounts_are_exactly_the_tree_minus_the_root(
    version: str, libs: set[str], folder: str, bins: set[str], prefix: str
) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / prefix if prefix else Path(d)
        libs = libs | {"libnvidia-ml.so"}
        for lib in libs:
            _file(root, f"{folder}/{lib}.{version}")
            _link(root, f"{folder}/{lib}.1", f"{lib}.{version}")
            _file(root, f"{folder}/{lib}.1.2.3.bak")  # looks versioned, is not the version
        for b in bins:
            _file(root, f"/usr/bin/{b}", "#!/bin/sh\n", 0o755)
        files = discover(root, hook_dirs=())
        assert files.version == version
        containers = _containers(files.mounts)
        assert len(set(containers)) == len(containers)
        for m in files.mounts:
            assert m.container_path.startswith("/")
            assert m.host_path == str(root) + m.container_path
            assert os.path.isfile(m.host_path)
        assert set(containers) == {f"{folder}/{lib}.{version}" for lib in libs} | {
            f"/usr/bin/{b}" for b in bins
        }
        assert files.library_dirs == (folder,)


def test_nvml_library_is_the_newest_libnvidia_ml_under_the_root(tmp_path: Path) -> None:
    _driver_tree(tmp_path)
    _file(tmp_path, f"{LIBDIR}/libnvidia-ml.so.470.42.01")
    assert nvml_library(tmp_path) == tmp_path / LIBDIR.lstrip("/") / f"libnvidia-ml.so.{VERSION}"


def test_nvml_library_follows_links_inside_the_root_only(tmp_path: Path) -> None:
    # The GPU Operator's driver root: /usr/lib64 is a link into the root, never out of it.
    _file(tmp_path, f"/usr/lib/nvidia/libnvidia-ml.so.{VERSION}")
    _link(tmp_path, "/usr/lib64", "/usr/lib/nvidia")
    assert nvml_library(tmp_path) == tmp_path / f"usr/lib/nvidia/libnvidia-ml.so.{VERSION}"
    assert nvml_library(tmp_path / "usr" / "bin") is None
