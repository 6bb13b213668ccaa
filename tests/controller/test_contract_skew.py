"""The controller and a node's plugin may be one contract version apart in either direction;
further apart, the controller does not read that node's slices, places nothing there, and says
why on the Node and in a gauge (issue 42.1, docs/architecture.md "Version skew").

The versions are bumped in the test (`driver.contract.CONTRACT_VERSION`), so no second
checkout is needed: "N" is whatever the test sets."""

from __future__ import annotations

import pytest

from controller.cache import slice_view
from controller.metrics import ControllerMetrics
from controller.objects import EventType, Kind
from driver import contract
from driver.apiobject import Obj
from tests.support.engine_cluster import DRIVER, Cluster, node, profile_claim, slices

N = 5
KEY = contract.Contract(DRIVER).contract_version_key


def _labelled(node_name: str, version: str | None) -> list[Obj]:
    """`node_name`'s slices as a plugin that speaks `version` publishes them (None: a plugin
    from before the declaration, which labels nothing), kept as the controller's informer
    keeps them (`slice_view`, which must not trim the label away)."""
    out = slices(node_name, ["A100-SXM4-40GB"])
    for s in out:
        if version is not None:
            s["metadata"]["labels"] = {KEY: version}
    view = slice_view()
    return [view(s) for s in out]


def _cluster(
    monkeypatch: pytest.MonkeyPatch, plugin: str | None
) -> tuple[Cluster, ControllerMetrics]:
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    metrics = ControllerMetrics()
    c = Cluster({}, metrics=metrics)
    c.rec.enqueue(Kind.NODE, EventType.ADDED, node("n1"))
    for s in _labelled("n1", plugin):
        c.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    return c, metrics


def _skew_events(c: Cluster) -> list[tuple[str, str, str, str]]:
    return [e for e in c.recorder.events if e[2] == "ContractSkew"]


@pytest.mark.parametrize(
    "plugin",
    [str(N - 1), str(N), str(N + 1)],
    ids=["plugin N-1", "plugin N", "plugin N+1"],
)
def test_a_plugin_one_version_away_is_placed_on(
    monkeypatch: pytest.MonkeyPatch, plugin: str
) -> None:
    c, metrics = _cluster(monkeypatch, plugin)
    c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    alloc = c.allocation("c1")
    assert alloc is not None and alloc["devices"]["results"][0]["pool"] == "n1"
    assert _skew_events(c) == []
    assert metrics.registry.get_sample_value("carve_contract_skew_nodes") == 0


def test_a_plugin_that_declares_nothing_is_contract_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releases before the declaration spoke contract 1: read as such, not refused."""
    monkeypatch.setattr(contract, "CONTRACT_VERSION", 2)
    c = Cluster({})
    c.rec.enqueue(Kind.NODE, EventType.ADDED, node("n1"))
    for s in _labelled("n1", None):
        c.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    assert c.allocation("c1") is not None
    monkeypatch.setattr(contract, "CONTRACT_VERSION", 3)  # now two away from an unlabelled one
    c.rec.enqueue(Kind.SLICE, EventType.MODIFIED, _labelled("n1", None)[0])
    c.rec.step()
    assert "speaks carve contract version 1, older than" in _skew_events(c)[0][3]


@pytest.mark.parametrize(
    ("plugin", "newer"), [(str(N + 2), "newer"), (str(N - 2), "older")], ids=["N+2", "N-2"]
)
def test_a_plugin_two_versions_away_is_refused_told_and_counted(
    monkeypatch: pytest.MonkeyPatch, plugin: str, newer: str
) -> None:
    now = [100.0]
    monkeypatch.setattr(contract, "CONTRACT_VERSION", N)
    metrics = ControllerMetrics()
    c = Cluster({}, metrics=metrics, clock=lambda: now[0])
    c.rec.enqueue(Kind.NODE, EventType.ADDED, node("n1"))
    for s in _labelled("n1", plugin):
        c.rec.enqueue(Kind.SLICE, EventType.ADDED, s)
    c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()

    assert c.allocation("c1") is None
    assert c.planner.model.gpus_on("n1") == []
    (event,) = _skew_events(c)
    name, type_, _, message = event
    assert (name, type_) == ("n1", "Warning")
    assert f"the carve kubelet plugin on node n1 speaks carve contract version {plugin}" in message
    assert f"{newer} than this controller ({N}) by more than 1" in message
    assert KEY in message
    assert metrics.registry.get_sample_value("carve_contract_skew_nodes") == 1

    c.rec.step()  # nothing changed: not told again
    assert len(_skew_events(c)) == 1
    now[0] += 301  # still skewed after the event interval: told again (events expire)
    c.rec.step()
    assert len(_skew_events(c)) == 2

    # The plugin is upgraded to this controller's version: its slices are read, the pod placed.
    for s in _labelled("n1", str(N)):
        c.rec.enqueue(Kind.SLICE, EventType.MODIFIED, s)
    c.rec.step()
    c.rec.step()
    assert metrics.registry.get_sample_value("carve_contract_skew_nodes") == 0
    assert c.allocation("c1") is not None


def test_an_unreadable_version_is_refused_with_what_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c, metrics = _cluster(monkeypatch, "two")
    c.submit(profile_claim("c1", "1g.5gb"))
    c.rec.step()
    assert c.allocation("c1") is None
    (event,) = _skew_events(c)
    assert f"(label {KEY}) declares contract version 'two', not a positive integer" in event[3]
    assert metrics.registry.get_sample_value("carve_contract_skew_nodes") == 1


def test_claims_allocated_on_a_node_that_becomes_skewed_keep_their_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plugin rolled two versions ahead: its running claims' slices stay held, so nothing
    else is placed on them when the node is in range again."""
    c, _ = _cluster(monkeypatch, str(N))
    c.submit(profile_claim("c1", "7g.40gb"))
    c.rec.step()
    assert c.allocation("c1") is not None
    for s in _labelled("n1", str(N + 2)):
        c.rec.enqueue(Kind.SLICE, EventType.MODIFIED, s)
    c.rec.step()
    assert len(_skew_events(c)) == 1
    for s in _labelled("n1", str(N)):
        c.rec.enqueue(Kind.SLICE, EventType.MODIFIED, s)
    c.rec.step()
    c.submit(profile_claim("c2", "1g.5gb"))
    c.rec.step()
    assert c.allocation("c2") is None  # the whole GPU is still c1's
