"""Real-node suite: the real control plane, the real carve-controller, and real nodes (upstream
kubelet v1.37.2 + containerd 2.x + runc) running the real carve-kubelet-plugin on simulated
GPUs. Pods run real containers from the local test image.

Marked ``realnode``; CI runs it (CARVE_REQUIRE_CLUSTER makes a missing binary a failure there,
never a skip). Two nodes per package, shared by the tests; see harness.RealEnv.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from devcluster.pytest_plugin import k8s_cluster  # noqa: F401  (fixture, used by name)
from nodesim.stack import CarveStack
from realnode.binaries import NodeBinariesUnavailableError, ensure_node_binaries
from realnode.cluster import RealNodes
from realnode.node import RealNodeSpec
from tests.e2e.harness import environment_for
from tests.realnode.harness import (
    NODE_A,
    NODE_H,
    REAL_GROUP,
    REAL_GROUP_LABEL,
    REAL_NAMESPACES,
    RealEnv,
)

_SPECS = (
    RealNodeSpec(NODE_A, ("A100-SXM4-40GB",), labels={REAL_GROUP_LABEL: REAL_GROUP}),
    RealNodeSpec(NODE_H, ("H100-SXM5-80GB",), labels={REAL_GROUP_LABEL: REAL_GROUP}),
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "carve_real" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realnode)


@pytest.fixture(scope="package")
def carve_real(
    k8s_cluster: LocalCluster,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[CarveStack, RealNodes]]:
    try:
        binaries = ensure_node_binaries()
    except NodeBinariesUnavailableError as exc:
        if os.environ.get("CARVE_REQUIRE_CLUSTER"):
            raise RuntimeError(
                f"CARVE_REQUIRE_CLUSTER is set but real nodes cannot run: {exc}"
            ) from exc
        pytest.skip(f"real nodes unavailable: {exc}")
    kubeconfig = Path(k8s_cluster.info.kubeconfig)
    stack = CarveStack(kubeconfig, tmp_path_factory.mktemp("carve-real"))
    real = RealNodes(kubeconfig, stack.api, binaries=binaries)
    try:
        stack.install(gate_namespaces=REAL_NAMESPACES)
        stack.start_controller()
        for spec in _SPECS:
            real.add_node(spec)
        yield stack, real
    finally:
        real.stop()
        stack.stop()


@pytest.fixture
def env(
    carve_real: tuple[CarveStack, RealNodes], request: pytest.FixtureRequest
) -> Iterator[RealEnv]:
    stack, real = carve_real
    environment = RealEnv(stack, real, request.node.name)
    yield from environment_for(stack, request, env=environment)
