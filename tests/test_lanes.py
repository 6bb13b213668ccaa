"""Every test file is run by `make test`: each test belongs to exactly one lane, and that
lane's pytest collects its file (tests/support/lanes.py)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from tests.support.lanes import LANES, REPO, TEST_FILE, lane_of, lanes_missing


def _test_files() -> list[Path]:
    """Test files by pytest's naming, tracked or new (not ignored), anywhere in the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [Path(p) for p in listed if TEST_FILE.search(p) and (REPO / p).exists()]


def test_every_test_file_is_collected_by_the_lane_its_tests_belong_to() -> None:
    files = _test_files()
    assert len(files) > 100, files  # the listing found the suite
    missing = {str(p): sorted(lanes_missing(p)) for p in files if lanes_missing(p)}
    assert not missing, (
        f"test files no lane runs (lane -> its pytest does not collect the file): {missing}; "
        "move them under tests/ or give tests/support/lanes.py a lane that collects them"
    )


def test_a_test_file_outside_every_lane_is_found() -> None:
    assert lanes_missing(Path("devcluster/test_ports.py")) == {"unit", "cluster"}
    assert lanes_missing(Path("tests/driver/test_cdi.py")) == set()
    assert lanes_missing(Path("tests/e2e/test_churn.py")) == set()


def test_each_test_has_one_lane_and_only_that_lane_keeps_it() -> None:
    cases = {
        ("tests/driver/test_cdi.py", (), ()): "unit",
        ("tests/cluster/test_dra_api.py", ("cluster",), ()): "cluster",
        ("tests/kubeletplugin/test_main.py", (), ("k8s_cluster",)): "cluster",
        ("tests/e2e/test_churn.py", ("cluster",), ("k8s_cluster",)): "e2e",
        ("tests/realnode/test_mps.py", ("realnode",), ()): "realnode",
    }
    for (path, markers, fixtures), lane in cases.items():
        assert lane_of(Path(path), markers, fixtures) == lane, path
    for each in LANES.values():
        assert each.reaches(Path("tests/e2e/test_churn.py")) == (each.name == "e2e"), each.name


def test_the_file_pattern_is_pytests() -> None:
    """`TEST_FILE` is pytest's default `python_files`; a project setting would change it."""
    pytest_config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
    options = pytest_config["ini_options"]
    assert "python_files" not in options
    assert options["testpaths"] == ["tests"]
