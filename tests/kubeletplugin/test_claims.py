from __future__ import annotations

from typing import Any

import pytest

from kubeletplugin.claims import ClaimFormatError, parse_claim


def _claim(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": "c",
            "uid": "u-1",
            "resourceVersion": "7",
            "finalizers": ["x/y"],
        },
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": status,
    }


def test_parse_allocated_claim() -> None:
    view = parse_claim(
        _claim(
            allocation={
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": "mig.carve.dev", "pool": "n1", "device": "d"},
                        {"request": "nic", "driver": "other", "pool": "n1", "device": "e"},
                    ],
                    "config": [
                        {
                            "source": "FromClass",
                            "requests": ["gpu"],
                            "opaque": {"driver": "mig.carve.dev", "parameters": {"a": 1}},
                        },
                        {"source": "FromClaim"},
                    ],
                }
            },
            reservedFor=[{"resource": "pods", "name": "p", "uid": "pu"}],
        )
    )
    assert view.allocated and not view.deleting
    assert [r.device for r in view.results_for("mig.carve.dev")] == ["d"]
    assert len(view.config) == 1 and view.config[0].parameters == {"a": 1}
    assert view.config[0].source == "FromClass" and view.config[0].requests == ("gpu",)
    assert view.reserved_for == ("pods/p",)
    assert view.finalizers == ("x/y",)


def test_unallocated_and_deleting() -> None:
    obj = _claim()
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    view = parse_claim(obj)
    assert not view.allocated and view.deleting and view.results == ()


def test_malformed_result_is_a_format_error() -> None:
    obj = _claim(allocation={"devices": {"results": [{"request": "gpu", "driver": 3}]}})
    with pytest.raises(ClaimFormatError, match=r"results\[0\]\.driver"):
        parse_claim(obj)


def test_a_repeated_claim_event_folds_into_one_series() -> None:
    """The kubelet retries a failing prepare every few seconds; each try used to post a new
    Event, so an hour of it left hundreds on the claim. Now one Event counts them."""
    from kubeletplugin.claims import KubernetesClaimEvents
    from tests.support.fake_events import FakeEventsApi

    api = FakeEventsApi()
    events = KubernetesClaimEvents(api, driver="mig.carve.dev", node="n1")
    for _ in range(3):
        events.event(
            "ns", "c", "u", type_="Warning", reason="PrepareFailed", message="no such device"
        )
    (event,) = api.events.values()
    assert event["series"]["count"] == 3
    assert event["reportingController"] == "mig.carve.dev/kubelet-plugin"
    assert event["reportingInstance"] == "mig.carve.dev/kubelet-plugin-n1"
    assert (event["action"], event["regarding"]["kind"]) == ("Prepare", "ResourceClaim")


def test_node_events_name_the_node_and_fold_too() -> None:
    from kubeletplugin.nodeevents import NODE_EVENT_NAMESPACE, KubernetesNodeEvents
    from process.kube.errors import api_error
    from tests.support.fake_events import FakeEventsApi

    class Api(FakeEventsApi):
        def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
            if path == "/api/v1/nodes/n1":
                raise api_error(403, "nodes is forbidden")  # the name stands in for the UID
            return super().request(method, path, **kw)

    api = Api()
    events = KubernetesNodeEvents(api, driver="mig.carve.dev", node="n1")
    events.event(type_="Warning", reason="GpuUnhealthy", message="GPU 0: XID 79")
    events.event(type_="Warning", reason="GpuUnhealthy", message="GPU 0: XID 79")
    (((namespace, _), event),) = api.events.items()
    assert namespace == NODE_EVENT_NAMESPACE
    assert event["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "n1"}
    assert (event["action"], event["series"]["count"]) == ("GpuHealth", 2)
