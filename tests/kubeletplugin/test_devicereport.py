"""Which MIG device a prepared claim got, told on the claim and in a metric (issue 31,
point 3): nobody could tell before, because a slice carved on demand gets its UUID only at
prepare time and neither the ResourceSlice nor the allocation names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from driver.nvml import sim
from process.kube.errors import api_error
from tests.kubeletplugin.node_harness import DRIVER, Node, mig, open_node, whole
from tests.support.promtext import Sample, samples

H100 = "H100-SXM5-80GB"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [H100, H100])
    n.start()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def _metric(n: Node, name: str) -> list[Sample]:
    return samples(generate_latest(n.p.metrics.registry).decode(), name)


def _entries(n: Node, name: str) -> list[dict[str, object]]:
    return list(n.claims.objects[("default", name)]["status"].get("devices") or [])


def test_the_claim_says_which_mig_device_each_request_got(node: Node) -> None:
    n = node
    other = {"driver": "net.example.com", "pool": "p", "device": "nic0", "data": {"x": 1}}
    ref = n.claims.add("c", [mig(n.backend, 0, 9, 4), whole(1)])
    n.claims.objects[("default", "c")]["status"]["devices"] = [dict(other)]  # another driver's
    assert n.p.prepare([ref])[ref.uid].error == ""
    rec = n.p.checkpoint().claims[ref.uid]
    entries = {e["device"]: e for e in _entries(n, "c")}
    assert entries["nic0"] == other  # another writer's entry stays
    data = entries[mig(n.backend, 0, 9, 4)]["data"]
    d = rec.devices[0]
    assert data == {
        "apiVersion": f"{DRIVER}/v1alpha1",
        "kind": "PreparedDevice",
        "gpuUUID": n.gpu_uuid(0),
        "migUUID": d.mig_uuid,
        "profile": "3g.40gb",
        "profileID": 9,
        "gpuInstanceID": d.gi_id,
        "computeInstanceID": d.ci_id,
        "placement": {"start": 4, "size": 4},
    }
    assert entries["gpu-1"]["data"]["wholeGPU"] is True
    writes = n.claims.status_writes
    assert n.p.prepare([ref])[ref.uid].error == ""  # the kubelet asks again: nothing new
    assert n.claims.status_writes == writes

    info = _metric(n, "carve_prepared_slice_info")
    assert [s.labels for s in info] == [
        {
            "namespace": "default",
            "pod": "pod-c",
            "claim": "c",
            "request": "req0",
            "mig_uuid": d.mig_uuid,
            "gpu_uuid": n.gpu_uuid(0),
            "gpu_instance_id": str(d.gi_id),
            "profile": "3g.40gb",
        }
    ]
    assert n.p.unprepare([ref]) == {ref.uid: ""}
    assert _entries(n, "c") == [other]  # what this node wrote is taken back, the rest stays
    assert _metric(n, "carve_prepared_slice_info") == []


def test_a_restart_tells_again_and_a_missing_permission_never_fails_a_prepare(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = node
    ref = n.claims.add("c", [mig(n.backend, 0, 19, 1)])
    assert n.p.prepare([ref])[ref.uid].error == ""
    n.claims.objects[("default", "c")]["status"]["devices"] = []  # as if the write was lost
    n.start()
    n.p.retry_pending()  # housekeeping tells what this process has not told
    assert [e["device"] for e in _entries(n, "c")] == [mig(n.backend, 0, 19, 1)]

    def refuse(*_: object) -> None:
        raise api_error(403, "resourceclaims/status is forbidden")

    monkeypatch.setattr(n.claims, "apply_device_status", refuse)
    other = n.claims.add("d", [mig(n.backend, 1, 19, 2)])
    assert n.p.prepare([other])[other.uid].error == ""  # prepared all the same

    def failures() -> float:
        got = _metric(n, "carve_device_status_writes_total")
        return sum(s.value for s in got if s.labels["result"] == "error")

    assert failures() == 1
    third = n.claims.add("e", [mig(n.backend, 1, 19, 3)])
    assert n.p.prepare([third])[third.uid].error == ""
    assert failures() == 1  # refused for good: not tried again on every prepare
