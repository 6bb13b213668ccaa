"""docs/guide/monitoring.md names carve's metrics: each must be one carve registers (a
counter's ``_total`` is prometheus_client's suffix, not part of the registered name)."""

from __future__ import annotations

import re

from tests.support.sourcetext import REPO, string_literals

PAGE = REPO / "docs" / "guide" / "monitoring.md"


def test_every_metric_on_the_page_is_registered() -> None:
    names = set(re.findall(r"`(carve_[a-z_]+)", PAGE.read_text()))
    assert len(names) >= 14
    literals = set(string_literals().split("\n"))
    missing = sorted(n for n in names if n.removesuffix("_total") not in literals)
    assert not missing, f"monitoring.md names metrics carve does not register: {missing}"
