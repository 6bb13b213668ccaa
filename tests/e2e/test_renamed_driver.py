"""carve installed under another driver name: every name both sides agree on follows it.

The controller, the kubelet plugin, the DeviceClasses and the admission policy all run as
`mig.example.com` next to the default install. The release handshake (DESIGN invariant 4) is
checked the hard way: the node's plugin is killed before the pod ends, so the node cannot
destroy the instance; the controller must keep the allocation while the node's finalizer is
there, and clear it only after the restarted plugin has torn the instance down.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.contract import Contract
from nodesim.stack import CarveStack
from tests.e2e.harness import E2E, cel, environment_for, request

pytestmark = pytest.mark.cluster

RENAMED = Contract("mig.example.com")
LABELS = {"e2e.carve.dev/renamed": "on"}


@pytest.fixture(scope="module")
def renamed_stack(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CarveStack]:
    stack = CarveStack(
        Path(k8s_cluster.info.kubeconfig), tmp_path_factory.mktemp("renamed"), contract=RENAMED
    )
    try:
        stack.install(gate_namespaces=LABELS)
        stack.start_controller()
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def renamed(renamed_stack: CarveStack, request: pytest.FixtureRequest) -> Iterator[E2E]:
    yield from environment_for(renamed_stack, request, LABELS)


def test_renamed_driver_places_and_releases_only_after_the_node_confirms(renamed: E2E) -> None:
    e2e = renamed
    node = e2e.node("h100", "H100-SXM5-80GB")
    profile = cel(f'device.attributes["{RENAMED.driver}"].profile == "1g.10gb"')
    e2e.template("one", [request("mig", [profile], device_class=RENAMED.mig_class)])
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "one"}}, run_seconds=4)

    pod = e2e.wait_phase("p", "Running")
    assert pod["spec"]["nodeName"] == node.name
    # Placed at once: carve's one Placed event, and no condition of either driver's name.
    wait_for(  # events are written beside the decision thread: the pod may run first
        "carve's Placed event on p",
        lambda: {e["reason"] for e in e2e.events("Pod", "p")},
        until=lambda reasons: "Placed" in reasons,
        timeout=30,
    )
    assert not [c for c in pod["status"]["conditions"] if "carve" in c["type"]]
    claim = e2e.claim_of("p", "mig")
    finalizers = set(claim["metadata"]["finalizers"])
    assert finalizers == {RENAMED.allocation_finalizer, RENAMED.node_finalizer(node.name)}
    [result] = e2e.results(claim)
    assert result["driver"] == RENAMED.driver
    assert node.hardware_view().instances

    # The node loses its plugin while the pod still runs: when the pod ends, nobody can
    # destroy the instance, so the node's finalizer stays and so must the allocation.
    node.kill_plugin()
    e2e.wait_phase("p", "Succeeded", timeout=30)
    name = claim["metadata"]["name"]

    def unreserved() -> bool:
        current = e2e.resource.read_namespaced_resource_claim(name, e2e.namespace)
        return not current.status.reserved_for

    wait_for("the claim to be reserved for nobody", unreserved, timeout=30)
    time.sleep(3.0)  # a few controller rounds: with the bug, the allocation was cleared here
    held = e2e.resource.read_namespaced_resource_claim(name, e2e.namespace)
    assert held.status.allocation is not None, "allocation cleared before the node confirmed"
    assert RENAMED.node_finalizer(node.name) in held.metadata.finalizers
    assert node.hardware_view().instances

    node.start_plugin()
    node.wait_plugin_ready()

    def released() -> bool:
        # kube-controller-manager deletes a generated claim once its pod is done; the
        # deletion completes when the last finalizer, ours, is gone.
        try:
            current = e2e.resource.read_namespaced_resource_claim(name, e2e.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return current.status.allocation is None and not (current.metadata.finalizers or [])

    wait_for("the release handshake to finish", released, timeout=60)
    assert not node.hardware_view().instances
    # A placement is told on the pod only; the claim's allocation said where it went.
    assert "Allocated" not in {e.get("reason") for e in e2e.events("ResourceClaim", name)}
