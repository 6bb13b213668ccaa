"""The summary over end-to-end runs (`python -m bench.cluster_packing --summarize`): several seeds
of one workload make one summary, and runs with different scheduler arms (carve with the default
profile in one run, with bin-packing in the next) are summarized together, each ratio taken
only within a run that has both arms. And the note a run gets when its clean-up left objects
behind."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.bench.cluster_figures import ArmFigures, ClassWaits, ceiling, headroom_closed
from tests.bench.cluster_runs import from_json, ratios, summarize
from tests.support.cluster_packing import leftovers

_CLASSES = ("1g", "2g-4g", "7g", "multi-GPU")


def _arm(arm: str, share: float, wait_7g: float) -> ArmFigures:
    waits = {c: ClassWaits(10, 1.0, wait_7g if c == "7g" else 100.0, 0) for c in _CLASSES}
    return ArmFigures(
        arm=arm,
        jobs=100,
        placed=90,
        placed_by_horizon=80,
        share=share,
        util=share,
        frag=0.1,
        bound=0.9,
        of_bound=share / 0.9,
        fluid=0.95,
        waits=waits,
        large=ClassWaits(20, 1.0, wait_7g, 0),
        max_large_wait=wait_7g,
        end=600.0,
        notes=("a note",),
    )


def _write(path: Path, workload: str, *arms: ArmFigures) -> Path:
    data = {"workload": workload, "head": [], "arms": [dataclasses.asdict(a) for a in arms]}
    path.write_text(json.dumps(data))
    return path


def test_a_run_reads_back_as_written(tmp_path: Path) -> None:
    arm = _arm("carve-least-waste", 0.8, 300.0)
    path = _write(tmp_path / "run.json", "mix inference", arm)
    assert from_json(json.loads(path.read_text())) == [arm]


def test_runs_with_different_scheduler_arms_are_summarized_together(tmp_path: Path) -> None:
    runs = [
        _write(
            tmp_path / "s1.json",
            "mix inference",
            _arm("carve-least-waste", 0.88, 800.0),
            _arm("scheduler-default", 0.72, 400.0),
        ),
        _write(
            tmp_path / "s1-binpack.json",
            "mix inference",
            _arm("carve-least-waste", 0.86, 600.0),
            _arm("scheduler-binpack", 0.80, 1200.0),
        ),
        _write(
            tmp_path / "s2.json",
            "mix inference",
            _arm("carve-least-waste", 0.90, 200.0),
            _arm("scheduler-default", 0.75, 400.0),
        ),
    ]
    lines = summarize(runs)
    assert lines[0] == "mix inference: 3 runs"
    carve = next(line for line in lines if line.strip().startswith("carve-least-waste "))
    assert "3 runs: share 0.880 [0.860-0.900]" in carve
    assert "7g p99 533 [200-800]s" in carve
    binpack = next(line for line in lines if line.strip().startswith("scheduler-binpack "))
    assert "1 runs: share 0.800 [0.800-0.800]" in binpack
    default_ratio = next(line for line in lines if "/ scheduler-default" in line)
    # Within each run: 0.88/0.72 and 0.90/0.75; 800/400 and 200/400.
    assert "(2 runs)" in default_ratio
    assert f"share x{(0.88 / 0.72 + 0.90 / 0.75) / 2:.3f} [1.200-1.222]" in default_ratio
    assert "7g p99 x1.250 [0.500-2.000]" in default_ratio
    # The bound is 0.9 in every run: 0.9/0.72 and 0.9/0.75; 0.16 of 0.18 and 0.15 of 0.15.
    assert "share ceiling x1.225 [1.200-1.250]" in default_ratio
    assert f"headroom closed {(0.16 / 0.18 + 1.0) / 2:.2f} [0.89-1.00]" in default_ratio
    binpack_ratio = next(line for line in lines if "/ scheduler-binpack" in line)
    assert "(1 runs): share x1.075 [1.075-1.075]" in binpack_ratio
    assert "7g p99 x0.500" in binpack_ratio


def test_workloads_are_summarized_apart(tmp_path: Path) -> None:
    lines = summarize(
        [
            _write(tmp_path / "a.json", "mix inference", _arm("carve-least-waste", 0.9, 1.0)),
            _write(tmp_path / "b.json", "trace default", _arm("carve-least-waste", 0.8, 1.0)),
        ]
    )
    assert [line for line in lines if not line.startswith(" ")] == [
        "mix inference: 1 runs",
        "trace default: 1 runs",
    ]


def test_a_ratio_over_a_zero_wait_is_not_a_number(tmp_path: Path) -> None:
    lines = summarize(
        [
            _write(
                tmp_path / "a.json",
                "mix inference",
                _arm("carve-least-waste", 0.9, 5.0),
                _arm("scheduler-default", 0.8, 0.0),
            )
        ]
    )
    ratio = next(line for line in lines if "/ scheduler-default" in line)
    assert "7g p99 xn/a" in ratio
    assert pytest.approx(0.9 / 0.8, abs=5e-4) == float(ratio.split("share x")[1].split(" ")[0])


def test_what_a_clean_up_left_says_which_side_did_not_let_go() -> None:
    pods = [
        {"metadata": {"name": "a", "deletionTimestamp": "2026-12-04T20:00:00Z"}},
        {"metadata": {"name": "b"}},
    ]
    claims: list[dict[str, Any]] = [
        {
            "metadata": {
                "name": "a-gpu",
                "deletionTimestamp": "2026-12-04T20:00:00Z",
                "finalizers": ["mig.carve.dev/node-a", "resource.kubernetes.io/delete-protection"],
            },
            "status": {"allocation": {"devices": {"results": []}}},
        },
        {"metadata": {"name": "b-gpu", "finalizers": ["mig.carve.dev/node-a"]}, "status": None},
        {"metadata": {"name": "c-gpu"}},
    ]
    assert leftovers(pods, claims) == (
        "2 pods (1 terminating), 3 claims (1 allocated, 1 terminating; 2 with "
        "mig.carve.dev/node-a; 1 with resource.kubernetes.io/delete-protection)"
    )
    per_node = [
        {"metadata": {"name": f"c{i}", "finalizers": [f"mig.carve.dev/node-{i % 5}"]}}
        for i in range(11)
    ]
    assert leftovers([], per_node) == (
        "0 pods (0 terminating), 11 claims (0 allocated, 0 terminating; 3 with "
        "mig.carve.dev/node-0; 2 with mig.carve.dev/node-1; 2 with mig.carve.dev/node-2; "
        "2 other finalizers)"
    )
    assert leftovers([], []) == "0 pods (0 terminating), 0 claims (0 allocated, 0 terminating)"


def test_a_run_says_how_much_of_the_schedulers_headroom_carve_took() -> None:
    carve, peer = _arm("carve-least-waste", 0.87, 500.0), _arm("scheduler-default", 0.78, 900.0)
    (line,) = ratios([carve, peer])
    # A bound of 0.9: no packer could have held more than 0.9/0.78 over the scheduler, and
    # carve took 0.09 of its 0.12 below the bound.
    assert line.startswith("carve-least-waste vs scheduler-default: share x1.115")
    assert line.endswith("share ceiling x1.154, headroom closed 0.75")


def test_headroom_is_not_a_number_where_the_scheduler_reached_the_bound() -> None:
    carve, peer = _arm("carve-least-waste", 0.85, 1.0), _arm("scheduler-binpack", 0.9, 1.0)
    assert math.isnan(headroom_closed(carve, peer))
    assert ceiling(carve, peer) == pytest.approx(1.0)
    below = _arm("scheduler-default", 0.8, 1.0)
    assert headroom_closed(carve, below) == pytest.approx(0.5)
    assert headroom_closed(_arm("carve-least-waste", 0.75, 1.0), below) == pytest.approx(-0.5)
