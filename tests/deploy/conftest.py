"""The Helm chart deploy/helm/carve, tested with the real helm (tests/support/helm.py) and, for
the `cluster` tests, against the real control plane (one cluster for this package).

`helm` is skipped, with the reason, when there is no Go toolchain to build helm with; with
CARVE_REQUIRE_CLUSTER set (CI) a missing helm fails instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.pytest_plugin import k8s_cluster  # noqa: F401  (fixture, used by name)
from tests.support.helm import Helm, helm_binary


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helm]:
    configured = os.environ.get("CARVE_HELM")
    binary = Path(configured) if configured else helm_binary()
    yield Helm(binary, tmp_path_factory.mktemp("helm-home"))
