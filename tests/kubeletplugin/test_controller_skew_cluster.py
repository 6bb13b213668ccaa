"""The skew rule's declarations over the real kube-apiserver (issue 42.1): the version each side
writes survives the apiserver (a label on ResourceSlices, an annotation on the Lease the real
leader election writes), each side's check reads the other's back from it, and the plugin's
refusal lands as a Warning event on its Node. Versions are bumped in the test."""

from __future__ import annotations

from typing import Any

import pytest

from controller.leader import LeaderElector, LeaseConfig
from controller.skew import NodeSkew
from devcluster.waiting import wait_for
from driver import contract
from driver.catalog import CATALOG
from driver.resourceslice import PublishedGpu, build_resource_slices
from kubeletplugin.controllerskew import REASON, ControllerContract
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.nodeevents import NODE_EVENT_NAMESPACE, KubernetesNodeEvents
from kubeletplugin.publisher import PublisherSettings, SlicePublisher
from process.kube.jsonclient import KubeJson

pytestmark = pytest.mark.cluster

DRIVER = "mig.skew.carve.dev"
N = 5


def _node_events(api: KubeJson, node: str) -> list[dict[str, Any]]:
    listing = api.request("GET", f"/apis/events.k8s.io/v1/namespaces/{NODE_EVENT_NAMESPACE}/events")
    return [
        e
        for e in listing.get("items") or []
        if e.get("reason") == REASON and (e.get("regarding") or {}).get("name") == node
    ]


def test_both_declarations_round_trip_and_a_skewed_controller_is_told_on_the_node(
    monkeypatch: pytest.MonkeyPatch, k8s_api: Any, fake_node: Any, namespace: str
) -> None:
    api = KubeJson(k8s_api)
    node = fake_node()

    # A plugin two versions ahead publishes; the controller at N reads its slices back.
    gpu = PublishedGpu(0, f"GPU-{node}-0", CATALOG["A100-SXM4-40GB"], "0000:07:00.0", "580.1")

    def build(generation: int, split: bool) -> list[dict[str, Any]]:
        return build_resource_slices(
            driver=DRIVER, node_name=node, pool_generation=generation, gpus=[gpu],
            split_counters=split,
        )  # fmt: skip

    publisher = SlicePublisher(PublisherSettings(DRIVER, node), api, build)
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N + 2)
    assert publisher.sync() is True
    stored = {s["metadata"]["name"]: s for s in publisher.existing()}
    assert stored
    key = contract.Contract(DRIVER).contract_version_key
    assert {s["metadata"]["labels"][key] for s in stored.values()} == {str(N + 2)}
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    why = NodeSkew(DRIVER).why(node, stored)
    assert f"speaks carve contract version {N + 2}, newer than this controller ({N})" in why
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N + 1)  # one apart: read
    assert NodeSkew(DRIVER).why(node, stored) == ""
    publisher.cleanup()

    # A controller two versions ahead holds the Lease; the plugin at N refuses and tells.
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N + 2)
    lease = LeaseConfig(name="carve-controller", namespace=namespace, driver_name=DRIVER)
    elector = LeaderElector(api, lease)
    assert elector.try_acquire_or_renew()
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    metrics = PluginMetrics()
    check = ControllerContract(
        api,
        (namespace, "carve-controller"),
        driver=DRIVER,
        events=KubernetesNodeEvents(api, driver=DRIVER, node=node),
        metrics=metrics,
    )
    check.poll()
    assert f"speaks carve contract version {N + 2}, newer than this kubelet plugin" in (
        check.refusal()
    )
    (event,) = wait_for(f"a {REASON} event on node {node}", lambda: _node_events(api, node))
    assert event["type"] == "Warning"
    assert event["regarding"]["kind"] == "Node"
    assert "this node prepares no new claim" in event["note"]
    assert metrics.registry.get_sample_value("carve_plugin_controller_contract_skew") == 1

    # The controller is rolled back to N: its next renewal declares N, the plugin prepares.
    elector.try_acquire_or_renew()
    check.poll()
    assert check.refusal() == ""
    assert metrics.registry.get_sample_value("carve_plugin_controller_contract_skew") == 0
