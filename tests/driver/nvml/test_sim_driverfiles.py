"""The simulator's node files: a fake driver root (with the nvidia-smi stand-in) and a dev root."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.devnodes import caps_major, parse_char_major
from driver.driverroot import discover
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.sim import driverfiles
from driver.nvml.sim.config import SimConfigError
from tests.support.nvml import SimFactory

A100, H100 = "A100-SXM4-40GB", "H100-SXM5-80GB"
VERSION = "555.42.06"
SHELLS = [["/bin/sh"]] + ([["busybox", "sh"]] if shutil.which("busybox") else [])
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating device nodes needs root")


def _node(
    make_sim: SimFactory, tmp_path: Path, gpus: Sequence[object] = (A100, H100)
) -> NvmlBackend:
    nv = make_sim(list(gpus), options={"driver_version": VERSION, "cuda_driver_version": 12080})
    nv.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    return NvmlBackend(nv, proc_root=nv.sim_proc_root()).open()


def _smi(
    script: Path, visible: str | None, *args: str, shell: Sequence[str] = ("/bin/sh",)
) -> tuple[int, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if visible is not None:
        env["NVIDIA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(
        [*shell, str(script), *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.returncode, out.stdout


def test_driver_root_has_the_simulated_driver(make_sim: SimFactory, tmp_path: Path) -> None:
    _node(make_sim, tmp_path)
    root = tmp_path / "driver"
    libdir = root / driverfiles.library_dir()
    for lib in ("libnvidia-ml.so", "libcuda.so"):
        assert (libdir / f"{lib}.{VERSION}").is_file()
        assert os.readlink(libdir / f"{lib}.1") == f"{lib}.{VERSION}"
    assert (root / "lib/firmware/nvidia" / VERSION / "gsp_ga10x.bin").is_file()
    smi = root / "usr/bin/nvidia-smi"
    assert smi.read_text().startswith("#!/bin/sh\n")
    assert stat.S_IMODE(smi.stat().st_mode) == 0o755
    # The plugin's discovery sees a driver of the simulated version, nvidia-smi and the MPS
    # control stand-in included.
    files = discover(root, hook_dirs=())
    assert files.version == VERSION
    assert sorted(m.container_path for m in files.mounts) == sorted(
        [
            f"/{driverfiles.library_dir()}/libnvidia-ml.so.{VERSION}",
            f"/{driverfiles.library_dir()}/libcuda.so.{VERSION}",
            "/usr/bin/nvidia-smi",
            "/usr/bin/nvidia-cuda-mps-control",
            f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        ]
    )
    assert _smi(smi, None, "--version")[1].splitlines()[-1].endswith(": 12.8")


def test_provisioning_is_idempotent(make_sim: SimFactory, tmp_path: Path) -> None:
    _node(make_sim, tmp_path)
    before = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in tmp_path.rglob("*")}
    sim.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    after = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in tmp_path.rglob("*")}
    changed = {p for p in before.keys() & after.keys() if before[p] != after[p]}
    assert before.keys() == after.keys()
    assert {p for p in changed if "driver" in p.parts or "devroot" in p.parts} == set()


@pytest.mark.parametrize("shell", SHELLS, ids=lambda s: s[0])
def test_nvidia_smi_lists_exactly_the_visible_devices(
    make_sim: SimFactory, tmp_path: Path, shell: list[str]
) -> None:
    backend = _node(make_sim, tmp_path)
    a100, h100 = backend.gpus()
    one = backend.carve(a100.uuid, 19, 3)  # 1g.5gb
    two = backend.carve(a100.uuid, 19, 5)
    big = backend.carve(h100.uuid, 9, 4)  # 3g.40gb
    smi = tmp_path / "driver/usr/bin/nvidia-smi"

    assert _smi(smi, one.mig_uuid, "-L", shell=shell) == (
        0,
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {a100.uuid})\n"
        f"  MIG 1g.5gb      Device  0: (UUID: {one.mig_uuid})\n",
    )
    # Only the named devices, each under its GPU, numbered as the container sees them.
    assert _smi(smi, f"{big.mig_uuid},{two.mig_uuid}", "-L", shell=shell)[1] == (
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {a100.uuid})\n"
        f"  MIG 1g.5gb      Device  0: (UUID: {two.mig_uuid})\n"
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {h100.uuid})\n"
        f"  MIG 3g.40gb     Device  0: (UUID: {big.mig_uuid})\n"
    )
    everything = (
        f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {a100.uuid})\n"
        f"  MIG 1g.5gb      Device  0: (UUID: {one.mig_uuid})\n"
        f"  MIG 1g.5gb      Device  1: (UUID: {two.mig_uuid})\n"
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {h100.uuid})\n"
        f"  MIG 3g.40gb     Device  0: (UUID: {big.mig_uuid})\n"
    )
    assert _smi(smi, "all", "-L", shell=shell) == (0, everything)
    assert _smi(smi, None, "--list-gpus", shell=shell) == (0, everything)
    assert _smi(smi, h100.uuid, "-L", shell=shell)[1] == (
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {h100.uuid})\n"
        f"  MIG 3g.40gb     Device  0: (UUID: {big.mig_uuid})\n"
    )
    for nothing in ("none", "void", "", "MIG-00000000-0000-0000-0000-000000000000"):
        assert _smi(smi, nothing, "-L", shell=shell) == (6, "No devices were found\n")
    header = _smi(smi, one.mig_uuid, shell=shell)[1].splitlines()[0]
    assert header.startswith(f"NVIDIA-SMI {VERSION}") and "CUDA Version: 12.8" in header
    assert _smi(smi, "all", "-q", shell=shell)[0] == 2


def test_nvidia_smi_follows_the_state_in_place(make_sim: SimFactory, tmp_path: Path) -> None:
    """The file is rewritten, never replaced: a bind mount (here a hard link, which holds the
    inode as a mount does) sees the current devices, and runc never finds its source deleted."""
    backend = _node(make_sim, tmp_path)
    gpu = backend.gpus()[0]
    smi = tmp_path / "driver/usr/bin/nvidia-smi"
    mounted = tmp_path / "mounted"
    os.link(smi, mounted)
    inode = smi.stat().st_ino
    carved = backend.carve(gpu.uuid, 19, 0)
    assert carved.mig_uuid in _smi(mounted, carved.mig_uuid, "-L")[1]
    backend.destroy(gpu.uuid, carved.gi_id)
    assert _smi(mounted, carved.mig_uuid, "-L") == (6, "No devices were found\n")
    assert smi.stat().st_ino == inode
    assert mounted.read_bytes() == smi.read_bytes()
    assert not [p for p in smi.parent.iterdir() if p.name.startswith(".")]  # no temp files left


def test_a_listing_during_rewrites_is_never_torn(make_sim: SimFactory, tmp_path: Path) -> None:
    """Containers run nvidia-smi while neighbours carve on the same node: every answer is the
    listing of one state, the one before a rewrite or the one after it."""
    backend = _node(make_sim, tmp_path)
    gpu = backend.gpus()[0]
    smi = tmp_path / "driver/usr/bin/nvidia-smi"
    keep = backend.carve(gpu.uuid, 19, 0)
    expected_line = f"  MIG 1g.5gb      Device  0: (UUID: {keep.mig_uuid})"
    stop = threading.Event()
    answers: list[tuple[int, str]] = []

    def churn() -> None:
        while not stop.is_set():
            other = backend.carve(gpu.uuid, 19, 6)  # changes the table's length each time
            backend.destroy(gpu.uuid, other.gi_id)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(40):
            answers.append(_smi(smi, keep.mig_uuid, "-L"))
    finally:
        stop.set()
        writer.join()
    want = (0, f"GPU 0: NVIDIA A100-SXM4-40GB (UUID: {gpu.uuid})\n{expected_line}\n")
    assert [a for a in answers if a != want] == []


def test_another_process_keeps_the_files_current(make_sim: SimFactory, tmp_path: Path) -> None:
    backend = _node(make_sim, tmp_path)
    # Another process knows only the config file, not the roots: those come from the state.
    sim.configure(
        {
            "state": str(sim.sim_config().state_path),
            "gpus": [A100, H100],
            "options": {"driver_version": VERSION, "cuda_driver_version": 12080},
        }
    )
    fresh = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()
    gpu = fresh.gpus()[1]
    carved = fresh.carve(gpu.uuid, 19, 0)
    assert carved.mig_uuid in (tmp_path / "driver/usr/bin/nvidia-smi").read_text()
    sim.sim_reboot()
    assert carved.mig_uuid not in (tmp_path / "driver/usr/bin/nvidia-smi").read_text()
    backend.close()


def _char(path: Path) -> tuple[int, int, int]:
    st_ = path.lstat()
    assert stat.S_ISCHR(st_.st_mode), path
    return os.major(st_.st_rdev), os.minor(st_.st_rdev), stat.S_IMODE(st_.st_mode)


@needs_root
def test_dev_root_holds_the_nodes_the_specs_name(make_sim: SimFactory, tmp_path: Path) -> None:
    backend = _node(make_sim, tmp_path, [A100, {"model": H100, "minor": 3}])
    dev = tmp_path / "devroot/dev"
    proc = sim.sim_proc_root()
    caps = caps_major(proc)
    uvm = parse_char_major((proc / "devices").read_text(), "nvidia-uvm")
    assert _char(dev / "nvidiactl") == (195, 255, 0o666)
    assert _char(dev / "nvidia0") == (195, 0, 0o666)
    assert _char(dev / "nvidia3") == (195, 3, 0o666)
    assert not (dev / "nvidia1").exists()
    assert _char(dev / "nvidia-uvm") == (uvm, 0, 0o666)
    assert _char(dev / "nvidia-uvm-tools") == (uvm, 1, 0o666)
    assert sorted(p.name for p in (dev / "nvidia-caps").iterdir()) == ["nvidia-cap1", "nvidia-cap2"]

    gpu = next(g for g in backend.gpus() if g.minor == 3)
    carved = backend.carve(gpu.uuid, 19, 2)
    gi_minor, ci_minor = backend.cap_minors(3, carved.gi_id, carved.ci_id)
    for minor in (gi_minor, ci_minor):
        assert _char(dev / f"nvidia-caps/nvidia-cap{minor}") == (caps, minor, 0o444)
    backend.destroy(gpu.uuid, carved.gi_id)
    assert sorted(p.name for p in (dev / "nvidia-caps").iterdir()) == ["nvidia-cap1", "nvidia-cap2"]


def test_without_root_the_nodes_are_skipped_and_said_once(
    make_sim: SimFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with caplog.at_level(logging.WARNING, logger="driver.nvml.sim"):
        backend = _node(make_sim, tmp_path)
        gpu = backend.gpus()[0]
        backend.destroy(gpu.uuid, backend.carve(gpu.uuid, 19, 0).gi_id)
    said = [r for r in caplog.records if r.getMessage() == "simulated device nodes not created"]
    assert len(said) == 1 and getattr(said[0], "reason", "") == "not running as root"
    assert not (tmp_path / "devroot/dev/nvidia0").exists()
    assert (tmp_path / "driver/usr/bin/nvidia-smi").exists()  # the driver root does not need root


def test_never_overwrites_a_real_driver(make_sim: SimFactory, tmp_path: Path) -> None:
    libdir = tmp_path / "driver" / driverfiles.library_dir()
    libdir.mkdir(parents=True)
    (libdir / f"libcuda.so.{VERSION}").write_bytes(b"\x7fELF real driver")
    nv = make_sim([A100], options={"driver_version": VERSION})
    with pytest.raises(SimConfigError, match="looks like a real driver root"):
        nv.sim_node_files(tmp_path / "driver", None)
    assert (libdir / f"libcuda.so.{VERSION}").read_bytes() == b"\x7fELF real driver"
    with pytest.raises(SimConfigError, match="never writes into the real driver root"):
        driverfiles.populate_driver_root(Path("/"), VERSION)
    with pytest.raises(SimConfigError, match="never creates nodes in the real /dev"):
        driverfiles.sync_dev_nodes(
            Path("/"), gpu_minors=[0], cap_minors=[], caps_major=1, uvm_major=2
        )


def test_a_new_driver_version_replaces_the_old_placeholders(
    make_sim: SimFactory, tmp_path: Path
) -> None:
    _node(make_sim, tmp_path)
    driverfiles.populate_driver_root(tmp_path / "driver", "580.105.08")
    libdir = tmp_path / "driver" / driverfiles.library_dir()
    assert sorted(p.name for p in libdir.iterdir()) == [
        "libcuda.so.1",
        "libcuda.so.580.105.08",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so.580.105.08",
    ]


# --- property: nvidia-smi -L shows exactly the visible MIG devices, each under its GPU ----------

_GPUS = [
    driverfiles.SmiGpu(
        f"GPU-{g:08x}-0000-0000-0000-000000000000",
        "NVIDIA A100-SXM4-40GB" if g % 2 == 0 else "NVIDIA H100 80GB HBM3",
        tuple(
            driverfiles.SmiMig(
                "1g.10gb+me" if m == 0 else "2g.20gb",
                f"MIG-{g:04x}{m:04x}-1111-2222-3333-444455556666",
            )
            for m in range(g + 1)
        ),
    )
    for g in range(3)
]
_ALL_MIGS = [(g, m) for g, gpu in enumerate(_GPUS) for m in range(len(gpu.migs))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chosen=st.lists(st.sampled_from(_ALL_MIGS), unique=True, min_size=1))
def test_listing_matches_the_chosen_devices(chosen: list[tuple[int, int]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "nvidia-smi"
        script.write_text(driverfiles.nvidia_smi_script("580.105.08", "13.0", _GPUS))
        visible = ",".join(_GPUS[g].migs[m].uuid for g, m in chosen)
        rc, out = _smi(script, visible, "-L")
    expected = []
    shown = 0
    for g, gpu in enumerate(_GPUS):
        mine = [m for m in range(len(gpu.migs)) if (g, m) in chosen]
        if not mine:
            continue
        expected.append(f"GPU {shown}: {gpu.name} (UUID: {gpu.uuid})")
        shown += 1
        for i, m in enumerate(mine):
            expected.append(
                f"  MIG {gpu.migs[m].profile:<12}Device {i:>2}: (UUID: {gpu.migs[m].uuid})"
            )
    assert rc == 0
    assert out.splitlines() == expected


def test_table_refuses_text_that_would_break_the_script() -> None:
    with pytest.raises(SimConfigError, match="cannot put"):
        driverfiles.nvidia_smi_script("1.0", "13.0", [driverfiles.SmiGpu("GPU-1", "it's")])


# --- inside a container: the device nodes decide, as with the real driver ---------------------

_NODE_GPUS = [
    driverfiles.SmiGpu(
        gpu.uuid,
        gpu.name,
        tuple(driverfiles.SmiMig(m.profile, m.uuid, 100 * g + i) for i, m in enumerate(gpu.migs)),
        minor=g,
    )
    for g, gpu in enumerate(_GPUS)
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chosen=st.lists(st.sampled_from(_ALL_MIGS), unique=True, min_size=1))
def test_in_a_container_the_device_nodes_decide(chosen: list[tuple[int, int]]) -> None:
    """A container that names a whole claim of two requests gets every slice's nodes but only
    one request's NVIDIA_VISIBLE_DEVICES; what it can open is what it has, and is listed."""
    with tempfile.TemporaryDirectory() as d:
        dev = Path(d) / "dev"
        (dev / "nvidia-caps").mkdir(parents=True)
        (dev / "nvidiactl").touch()
        for g, m in chosen:
            (dev / f"nvidia{g}").touch()
            (dev / "nvidia-caps" / f"nvidia-cap{100 * g + m}").touch()
        script = Path(d) / "nvidia-smi"
        script.write_text(driverfiles.nvidia_smi_script("580.105.08", "13.0", _NODE_GPUS))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CARVE_SIM_DEV_DIR": str(dev),
            "NVIDIA_VISIBLE_DEVICES": _NODE_GPUS[chosen[0][0]].migs[chosen[0][1]].uuid,
        }
        out = subprocess.run(
            ["/bin/sh", str(script), "-L"], check=False, env=env, capture_output=True, text=True
        )
    listed = re.findall(r"UUID: (MIG-[0-9a-f-]+)", out.stdout)
    assert out.returncode == 0
    assert sorted(listed) == sorted(_NODE_GPUS[g].migs[m].uuid for g, m in chosen)
    assert out.stdout.count("GPU ") == len({g for g, _ in chosen})
