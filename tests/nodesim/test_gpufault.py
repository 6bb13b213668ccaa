"""`python -m nodesim gpu`: a fault on one of the running demo's simulated GPUs reaches the
node's NVML the way it would reach the plugin, and bad input says what to do instead."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.waiting import wait_for
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from nodesim import gpufault
from nodesim.__main__ import main


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Path]:
    """A demo directory whose node host recorded one node, demo-h100, with two GPUs."""
    node_dir = tmp_path / "nodes" / "demo-h100"
    node_dir.mkdir(parents=True)
    sim.sim_write_config(
        node_dir / "sim.yaml",
        {"state": str(node_dir / "state.json"), "gpus": ["H100-SXM5-80GB", "A100-SXM4-40GB"]},
    )
    (tmp_path / "host.json").write_text(
        json.dumps({"pid": 1, "ready": True, "nodes": {"demo-h100": str(node_dir)}})
    )
    yield tmp_path
    sim.configure(node_dir / "sim.yaml")
    sim.sim_clear_faults()
    sim.configure(None)


def _backend(demo: Path) -> NvmlBackend:
    sim.configure(gpufault.sim_config_of(demo, "demo-h100"))
    return NvmlBackend(sim, proc_root=sim.sim_proc_root(), timeout=0.3).open()


def test_hang_makes_that_gpu_unresponsive_and_answer_brings_it_back(demo: Path) -> None:
    assert main(["gpu", "--dir", str(demo), "demo-h100", "0", "hang"]) == 0
    backend = _backend(demo)
    try:
        (a100,) = backend.gpus()  # the look that meets the hang leaves GPU 0 out
        assert a100.index == 1
        assert backend.unusable()[0].kind == "unresponsive"
        assert [h["gpu"] for h in sim.sim_hung_calls()] == [0]

        back = threading.Event()
        backend.on_responsiveness_change(back.set)
        assert main(["gpu", "--dir", str(demo), "demo-h100", "0", "answer"]) == 0
        sim.configure(gpufault.sim_config_of(demo, "demo-h100"))  # `main` leaves it unset
        assert back.wait(10)
        wait_for("GPU 0 listed again", lambda: len(backend.gpus()) == 2)
        assert not backend.unusable()
    finally:
        backend.close()


def test_fail_makes_that_gpu_failing_until_answer(demo: Path) -> None:
    assert main(["gpu", "--dir", str(demo), "demo-h100", "1", "fail", "UNKNOWN"]) == 0
    backend = _backend(demo)
    try:
        (h100,) = backend.gpus()
        assert h100.index == 0 and backend.unusable()[1].kind == "failing"
        assert len(backend.gpus()) == 1  # every look, not once
        assert main(["gpu", "--dir", str(demo), "demo-h100", "1", "answer"]) == 0
        sim.configure(gpufault.sim_config_of(demo, "demo-h100"))
        assert len(backend.gpus()) == 2 and not backend.unusable()
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo-a30", "0", "hang"], "the demo has no node 'demo-a30' (its nodes: demo-h100)"),
        (["demo-h100", "2", "hang"], "node 'demo-h100' has GPUs 0..1, not 2"),
        (["demo-h100", "0", "fail"], "`fail` needs an NVML error"),
        (["demo-h100", "0", "fail", "WEDGED"], "no NVML error named NVML_ERROR_WEDGED"),
    ],
)
def test_bad_input_says_what_is_wrong(
    demo: Path, args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gpu", "--dir", str(demo), *args]) == 2
    assert says in capsys.readouterr().err


def test_without_a_running_demo_it_says_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gpu", "--dir", str(tmp_path), "demo-h100", "0", "hang"]) == 2
    assert "start one with `make demo`" in capsys.readouterr().err
