"""`--lane NAME` keeps the tests of one lane (tests/support/lanes.py) and deselects the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lanes import LANES, lane_of

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=list(LANES),
        default=None,
        help="run only the tests of this lane (python -m tests.support.lanes runs them all)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lane = config.getoption("--lane")
    if lane is None:
        return
    keep, drop = [], []
    for item in items:
        here = lane_of(
            Path(item.path).relative_to(REPO),
            {m.name for m in item.iter_markers()},
            getattr(item, "fixturenames", ()),
        )
        (keep if here == lane else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
