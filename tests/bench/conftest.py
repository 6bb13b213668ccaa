"""The dra-allocate binary for the replay tests, with the control-plane fixture's policy: skip
where it cannot be had (no Go), fail where CARVE_REQUIRE_CLUSTER says it must be there; and
the control plane that the benchmarks' `cluster` tests (test_request_cost, test_scale,
test_cluster_packing) share; each leaves it as found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devcluster import BinariesUnavailableError
from devcluster.pytest_plugin import k8s_cluster  # noqa: F401  (fixture, used by name)
from tests.support.real_allocator import binary


@pytest.fixture(scope="session")
def dra_allocate() -> Path:
    try:
        return binary(build=False)
    except BinariesUnavailableError as exc:
        if os.environ.get("CARVE_REQUIRE_CLUSTER"):
            raise RuntimeError(
                f"CARVE_REQUIRE_CLUSTER is set but dra-allocate is missing: {exc}"
            ) from exc
        pytest.skip(f"dra-allocate unavailable: {exc}")
