"""pytest fixtures for suites that need the real control plane.

Import the fixtures by name in a suite's conftest (pytest refuses ``pytest_plugins`` outside
the top-level conftest; import them in a conftest, not a test module, whose package is then
the suite). Each importing conftest registers its own package fixture, so each suite gets
its own cluster, started on first use and stopped once the suite's last test is done: one
suite's cluster-scoped objects (admission policies, DeviceClasses, nodes) never leak into
another, the tests of a suite share one cluster and isolate by namespace, and a run never
keeps the idle control planes of finished suites (each costs about a twentieth of a core)
until its end.

- ``k8s_cluster`` (package): a running LocalCluster for the suite; skips, with the reason
  printed, when the binaries cannot be had (no Go, failed build). Set
  ``CARVE_DEVCLUSTER=<dir>`` to reuse a cluster started by ``python -m devcluster up``.
- ``k8s_api`` (package): an admin ``kubernetes.client.ApiClient`` for that cluster.
- ``node_heartbeater`` (package): the NodeHeartbeater keeping fake nodes Ready.
- ``fake_node`` (function): a factory ``fake_node(**FakeNode fields) -> name`` creating a
  uniquely named, heartbeating Node that is deleted after the test.
- ``namespace`` (function): a fresh namespace (with its default ServiceAccount) whose pods
  are force-deleted and which is deleted after the test.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from devcluster.binaries import BinariesUnavailableError, ensure_binaries
from devcluster.cluster import ClusterStartError, LocalCluster
from devcluster.nodes import FakeNode, NodeHeartbeater, delete_node

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


def _say(config: pytest.Config, message: str) -> None:
    """Print past pytest's output capture: whether the control plane ran, and why not,
    must be visible in every `make test` log."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    suspended = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with suspended:
        if reporter is not None:
            reporter.write_line(f"\ndevcluster: {message}")
        else:
            print(f"devcluster: {message}", file=sys.stderr)


class _Unavailable:
    """Why the control plane cannot run, found once per process, so every later suite
    skips at once instead of retrying the build."""

    reason: str | None = None


def _start(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    attach_dir = os.environ.get("CARVE_DEVCLUSTER")
    if attach_dir:
        cluster = LocalCluster.attach(Path(attach_dir))
        _say(config, f"reusing the cluster in {attach_dir} ({cluster.info.server})")
        return cluster
    # Logs stay under pytest's basetemp (the last three runs are kept) for post-mortems.
    root = tmp_path_factory.mktemp("devcluster", numbered=True)
    try:
        # Normally a cache check; on a machine that never built, this is the ~6 minute
        # build (`make test` runs it before pytest), with its progress shown live.
        binaries = ensure_binaries(progress=lambda line: _say(config, line))
        cluster = LocalCluster(root, binaries=binaries)
        info = cluster.start()
    except BinariesUnavailableError as exc:
        if os.environ.get("CARVE_REQUIRE_CLUSTER"):
            # CI has Go: a failed build there must fail the run, never turn it green by skipping.
            raise RuntimeError(
                f"CARVE_REQUIRE_CLUSTER is set but the control plane is unavailable: {exc}"
            ) from exc
        _Unavailable.reason = f"Kubernetes control plane unavailable: {exc}"
        _say(config, f"SKIPPING tests that need the control plane: {exc}")
        pytest.skip(_Unavailable.reason)
    except ClusterStartError:
        _say(config, f"control plane failed to start; logs in {root / 'logs'}")
        raise
    _say(
        config,
        f"control plane v1.37 up in {info.started_seconds:.1f}s at {info.server} "
        f"(logs {root / 'logs'})",
    )
    return cluster


@pytest.fixture(scope="package")
def k8s_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    if isinstance(request.node, pytest.Session):
        # Imported into a test module, a package fixture is the session's: that module's
        # cluster would idle until the run ends.
        raise pytest.UsageError(
            "import the devcluster fixtures in a package's conftest.py, not in a test module"
        )
    if _Unavailable.reason is not None:
        pytest.skip(_Unavailable.reason)
    cluster = _start(request.config, tmp_path_factory)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="package")
def k8s_api(k8s_cluster: LocalCluster) -> ApiClient:
    return k8s_cluster.api_client()


@pytest.fixture(scope="package")
def node_heartbeater(k8s_cluster: LocalCluster) -> Iterator[NodeHeartbeater]:
    beater = NodeHeartbeater(k8s_cluster.api_client()).start()
    try:
        yield beater
    finally:
        beater.stop()


@pytest.fixture
def fake_node(
    request: pytest.FixtureRequest, node_heartbeater: NodeHeartbeater, k8s_api: ApiClient
) -> Iterator[Callable[..., str]]:
    created: list[str] = []

    def make(**fields: Any) -> str:
        name = fields.pop("name", None) or _unique_name("node", request.node.name)
        node_heartbeater.add(FakeNode(name=name, **fields))
        created.append(name)
        return name

    yield make
    for name in created:
        node_heartbeater.forget(name)
        delete_node(k8s_api, name)


@pytest.fixture
def namespace(request: pytest.FixtureRequest, k8s_api: ApiClient) -> Iterator[str]:
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    name = _unique_name("t", request.node.name)
    core.create_namespace(
        client.V1Namespace.model_validate(
            {"metadata": {"name": name, "labels": {"carve.test/owner": "pytest"}}}
        )
    )
    _wait_for_default_service_account(core, name)
    try:
        yield name
    finally:
        # Workload controllers go first: a ReplicaSet outliving its pods would recreate them
        # while the namespace terminates, and a later test's carve-controller would then
        # place those orphans on its own node. No kubelet confirms graceful deletion, so pods
        # bound to a node would block the namespace forever; delete them immediately.
        apps, batch = client.AppsV1Api(k8s_api), client.BatchV1Api(k8s_api)
        for delete in (
            apps.delete_collection_namespaced_deployment,
            apps.delete_collection_namespaced_stateful_set,
            apps.delete_collection_namespaced_replica_set,
            batch.delete_collection_namespaced_job,
        ):
            delete(name, propagation_policy="Background")
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
        core.delete_namespace(name)


def _wait_for_default_service_account(core: Any, namespace: str, timeout: float = 30.0) -> None:
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def _unique_name(prefix: str, test_name: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{prefix}-{slug}-{uuid.uuid4().hex[:6]}"
