"""The plugin's side of the version-skew rule (issue 42.1, docs/architecture.md "Version
skew"): it labels its slices with the contract version it speaks, reads the one carve-controller
declares on its Lease, and refuses new prepares (never misreading an allocation) while the two
are more than one apart; unprepare goes on. Versions are bumped in the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver import contract
from driver.nvml import sim
from kubeletplugin.controllerskew import REASON, ControllerContract, parse_lease_ref
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.options import parse_options
from kubeletplugin.publisher import PublisherSettings, SlicePublisher
from process.flags import UsageError
from process.kube.errors import api_error
from tests.kubeletplugin.node_harness import DRIVER, NODE, FakeKubeJson, Node, mig, open_node

N = 5
KEY = contract.Contract(DRIVER).contract_version_key
LEASE = "/apis/coordination.k8s.io/v1/namespaces/carve-system/leases/carve-controller"


class LeaseApi:
    """carve-controller's Lease as the apiserver answers it; `lease=None` answers 404."""

    def __init__(self, annotations: dict[str, str] | None = None) -> None:
        self.lease: dict[str, Any] | None = {
            "metadata": {"name": "carve-controller", "annotations": annotations or {}},
            "spec": {"holderIdentity": "carve-controller-0"},
        }
        self.down = False

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        assert (method, path) == ("GET", LEASE)
        if self.down:
            raise api_error(503, "unavailable")
        if self.lease is None:
            raise api_error(404, '{"reason": "NotFound"}')
        return self.lease


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, ["A100-SXM4-40GB"])
    n.start()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _check(api: LeaseApi, n: Node, metrics: PluginMetrics) -> ControllerContract:
    check = ControllerContract(
        api, ("carve-system", "carve-controller"), driver=DRIVER, events=n, metrics=metrics
    )
    n.p.contract_refusal = check.refusal
    return check


def _gauge(metrics: PluginMetrics) -> float | None:
    return metrics.registry.get_sample_value("carve_plugin_controller_contract_skew")


@pytest.mark.parametrize("controller", [N - 1, N, N + 1], ids=["N-1", "N", "N+1"])
def test_a_controller_one_version_away_is_worked_with(
    monkeypatch: pytest.MonkeyPatch, node: Node, controller: int
) -> None:
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    metrics = PluginMetrics()
    check = _check(LeaseApi({KEY: str(controller)}), node, metrics)
    check.poll()
    assert check.refusal() == ""
    ref = node.claims.add("c1", [mig(node.backend, 0, 19, 6)])
    assert node.p.prepare([ref])[ref.uid].error == ""
    assert [e for e in node.node_events if e[1] == REASON] == []
    assert _gauge(metrics) == 0


@pytest.mark.parametrize(
    ("controller", "newer"), [(N + 2, "newer"), (N - 2, "older")], ids=["N+2", "N-2"]
)
def test_a_controller_two_versions_away_stops_new_prepares_only(
    monkeypatch: pytest.MonkeyPatch, node: Node, controller: int, newer: str
) -> None:
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    metrics = PluginMetrics()
    api = LeaseApi({KEY: str(N)})
    check = _check(api, node, metrics)
    check.poll()
    running = node.claims.add("running", [mig(node.backend, 0, 19, 6)])
    assert node.p.prepare([running])[running.uid].error == ""

    api.lease = {"metadata": {"annotations": {KEY: str(controller)}}}  # the controller rolled
    check.poll()
    (event,) = [e for e in node.node_events if e[1] == REASON]
    assert event[0] == "Warning"
    assert (
        f"carve-controller (Lease carve-system/carve-controller (annotation {KEY})) speaks "
        f"carve contract version {controller}, {newer} than this kubelet plugin ({N})"
    ) in event[2]
    assert _gauge(metrics) == 1
    new = node.claims.add("new", [mig(node.backend, 0, 19, 5)])
    result = node.p.prepare([new])[new.uid]
    assert "not prepared: carve-controller (Lease carve-system/carve-controller" in result.error
    assert node.instances() == [(0, 19, 6, 1)]  # nothing carved for it
    # What was prepared stays prepared and is torn down as ever.
    assert node.p.prepare([running])[running.uid].error == ""  # from the checkpoint
    assert node.p.unprepare([running])[running.uid] == ""
    assert node.instances() == []

    check.poll()  # the same verdict: not told again
    assert len([e for e in node.node_events if e[1] == REASON]) == 1
    api.down = True  # an apiserver outage keeps the verdict
    check.poll()
    assert check.refusal()
    api.down = False
    api.lease = {"metadata": {"annotations": {KEY: str(N)}}}  # the plugin's peer caught up
    check.poll()
    assert _gauge(metrics) == 0
    assert node.p.prepare([new])[new.uid].error == ""  # the kubelet's retry now succeeds


def test_a_lease_without_a_declaration_is_contract_1_and_without_a_lease_nothing_is_refused(
    monkeypatch: pytest.MonkeyPatch, node: Node
) -> None:
    monkeypatch.setattr(contract, "CONTRACT_VERSION", 3)
    metrics = PluginMetrics()
    api = LeaseApi()
    check = _check(api, node, metrics)
    check.poll()
    assert "speaks carve contract version 1, older than this kubelet plugin (3)" in check.refusal()
    api.lease = None  # leader election off: nothing to check against
    check.poll()
    assert check.refusal() == "" and _gauge(metrics) == 0


def test_an_unreadable_declaration_is_refused_with_what_is_wrong(node: Node) -> None:
    check = _check(LeaseApi({KEY: "v2"}), node, PluginMetrics())
    check.poll()
    assert check.refusal() == (
        f"Lease carve-system/carve-controller (annotation {KEY}) declares contract version "
        f"'v2', not a positive integer (e.g. \"{contract.CONTRACT_VERSION}\")"
    )


def test_the_slices_are_labelled_with_the_plugins_contract_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def build(generation: int, split: bool) -> list[dict[str, Any]]:
        return [{"metadata": {"name": "s"}, "spec": {"pool": {"generation": generation}}}]

    monkeypatch.setattr(contract, "CONTRACT_VERSION", N - 1)
    api = FakeKubeJson()
    publisher = SlicePublisher(PublisherSettings(DRIVER, NODE), api, build)  # type: ignore[arg-type]
    (desired,) = publisher._desired(1, True, [])
    assert desired["metadata"]["labels"] == {KEY: str(N - 1)}


@pytest.mark.parametrize("bad", ["carve-controller", "/carve-controller", "a/b/c", "ns/"])
def test_a_bad_controller_lease_flag_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError, match=r"--controller-lease: .* is not <namespace>/<name>"):
        parse_options(["--node-name", "n", "--controller-lease", bad], env={})
    assert parse_lease_ref("carve-system/carve-controller") == ("carve-system", "carve-controller")
