"""`carve gpus` and `carve demo` on the simulator, in-process and as the installed script."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from carvecli import main as cli
from driver.catalog import Placement
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.types import ComputeInstance, GpuInstance


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("CARVE_SIM_CONFIG", raising=False)
    config = sim.sim_write_config(
        tmp_path / "sim.yaml",
        {
            "state": "state.json",
            "gpus": [{"model": "A100-SXM4-40GB", "gi_id_layout": "identity"}, "A30-24GB"],
        },
    )
    sim.configure(config)
    with NvmlBackend(sim) as backend:
        a100 = backend.gpus()[0].uuid
        backend.carve(a100, 9, 4)  # 3g.20gb
        backend.carve(a100, 19, 1)  # 1g.5gb
    yield config
    sim.configure(None)


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


def _instance(gi: int, profile: int, start: int, size: int) -> GpuInstance:
    return GpuInstance(
        "GPU-x", gi, profile, Placement(start, size), (ComputeInstance(0, 0, 1, None),)
    )


def test_memory_map_labels_instances_by_position() -> None:
    assert cli.memory_map(8, [_instance(2, 9, 4, 4), _instance(8, 19, 1, 1)]) == "[.A..BBBB]"
    assert cli.memory_map(12, []) == "[............]"


def test_gpus_shows_instances_free_starts_and_capacity(node: Path) -> None:
    code, text = _run("gpus", "--sim", str(node))
    assert code == 0
    a100, a30 = text.strip().split("\n\n")
    assert "NVIDIA A100-SXM4-40GB" in a100 and "MIG on" in a100
    assert " .A..BBBB" in a100
    assert "A = 1g.5gb at 1:1, GPU instance 8" in a100
    assert "B = 3g.20gb at 4:4, GPU instance 2" in a100
    rows = {line.split()[0]: line.split()[2:] for line in a100.splitlines() if "gb (" in line}
    # placements, free starts (geometry) and remaining capacity (NVML), side by side
    assert rows["1g.5gb"] == ["0,1,2,3,4,5,6", "0,2,3", "3", "of", "7"]
    assert rows["2g.10gb"] == ["0,2,4", "2", "1", "of", "3"]
    assert rows["3g.20gb"] == ["0,4", "none", "0", "of", "2"]
    assert "4g.24gb (0)" in a30 and "A30" in a30


def test_gpus_uses_the_environment_config(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sim.configure(None)
    monkeypatch.setenv("CARVE_SIM_CONFIG", str(node))
    code, text = _run("gpus")
    assert code == 0 and "GPU instance 2" in text


def test_gpus_without_nvml_says_how_to_try_carve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("CARVE_SIM_CONFIG", raising=False)
    sim.configure(None)

    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    code, _ = _run("gpus")
    assert code == 2
    err = capsys.readouterr().err
    assert "NVIDIA driver" in err and "carve demo" in err


def test_bad_sim_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("state: s.json\ngpus: [Z80]\n")
    code, _ = _run("gpus", "--sim", str(bad))
    assert code == 1
    assert "unknown GPU model 'Z80'" in capsys.readouterr().err
    sim.configure(None)


def test_demo_carves_refuses_and_explains(tmp_path: Path) -> None:
    code, text = _run("demo", "--keep", str(tmp_path / "demo"))
    assert code == 0
    assert text.count("-> GPU instance") == 7
    assert "PlacementTaken" in text and "ResetRequired" in text
    assert "A = 2g.10gb, B = 1g.5gb+me" in text
    sim.configure(tmp_path / "demo" / "sim.yaml")
    with NvmlBackend(sim) as backend:
        left = {g.name: len(backend.instances(g.uuid)) for g in backend.gpus()}
    sim.configure(None)
    assert left == {
        "NVIDIA A100-SXM4-40GB": 2,
        "NVIDIA H100 80GB HBM3": 2,
        "NVIDIA RTX PRO 6000 Blackwell Server Edition": 2,
        "NVIDIA A30": 0,
    }


def test_installed_console_script(node: Path) -> None:
    script = Path(sys.executable).parent / "carve"
    env = {**os.environ, "CARVE_SIM_CONFIG": str(node)}
    done = subprocess.run(
        [str(script), "gpus"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "B = 3g.20gb at 4:4" in done.stdout
