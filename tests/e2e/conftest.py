"""End-to-end suite: real control plane (devcluster), the real carve-controller process, and
simulated GPU nodes running the real carve-kubelet-plugin with a kubelet-like node agent.

One control plane per session and one carve-controller for this package; every test gets its
own namespace and its own nodes (see harness.E2E). The shipped admission gate is bound to the
suite's namespaces only (by label), so other suites sharing the control plane are not gated.
The devcluster fixtures are imported because pytest accepts `pytest_plugins` only in the
top-level conftest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.cluster import LocalCluster
from devcluster.pytest_plugin import k8s_cluster  # noqa: F401  (fixture, used by name)
from nodesim.stack import CarveStack
from tests.e2e.harness import E2E, GATED_NAMESPACES, NATIVE_CLASS, environment_for


@pytest.fixture(scope="package")
def carve(
    k8s_cluster: LocalCluster,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CarveStack]:
    stack = CarveStack(Path(k8s_cluster.info.kubeconfig), tmp_path_factory.mktemp("carve"))
    try:
        stack.install(gate_namespaces=GATED_NAMESPACES)
        _native_class(stack)
        stack.start_controller()
        yield stack
    finally:
        stack.stop()


def _native_class(stack: CarveStack) -> None:
    """A class outside carve's set: the admission gate leaves its pods alone, so kube-scheduler
    allocates them from the published partitionable devices (the native path)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        client.ResourceV1Api(stack.api).create_device_class(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": NATIVE_CLASS},
                "spec": {
                    "selectors": [
                        {
                            "cel": {
                                "expression": 'device.driver == "mig.carve.dev" && '
                                'device.attributes["mig.carve.dev"].type == "mig"'
                            }
                        }
                    ]
                },
            }
        )
    except ApiException as exc:
        if exc.status != 409:
            raise


@pytest.fixture
def e2e(carve: CarveStack, request: pytest.FixtureRequest) -> Iterator[E2E]:
    yield from environment_for(carve, request)
