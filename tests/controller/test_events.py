"""KubeRecorder: the controller's events name the pod or claim they are about and go through
the one writer (`process.kube.events`, tested in tests/process/test_events.py); the real
apiserver's answers are in tests/controller/cluster/test_status_cluster.py."""

from __future__ import annotations

from controller.events import KubeRecorder
from controller.objects import Kind
from tests.support.fake_events import FakeEventsApi


def test_a_claim_event_names_the_claim_and_repeats_fold() -> None:
    api = FakeEventsApi()
    rec = KubeRecorder(api, controller="mig.carve.dev/controller", instance="ctl-0")
    claim = {"metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "3"}}
    rec.event(claim, Kind.CLAIM, "Warning", "NodeLost", "node n is lost")
    rec.event(claim, Kind.CLAIM, "Warning", "NodeLost", "node n is lost")
    (event,) = api.events.values()
    assert event["metadata"]["namespace"] == "ns"
    assert event["regarding"] == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": "c",
        "namespace": "ns",
        "uid": "u",
        "resourceVersion": "3",
    }
    assert (event["action"], event["type"], event["reason"]) == ("Allocate", "Warning", "NodeLost")
    assert event["reportingInstance"] == "ctl-0"
    assert event["series"]["count"] == 2


def test_a_pod_event_is_a_placement() -> None:
    api = FakeEventsApi()
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
    KubeRecorder(api).event(pod, Kind.POD, "Normal", "Placed", "placed on node-a")
    (event,) = api.events.values()
    assert (event["regarding"]["apiVersion"], event["regarding"]["kind"]) == ("v1", "Pod")
    assert event["action"] == "Place"
    assert event["reportingController"] == "mig.carve.dev/controller"
