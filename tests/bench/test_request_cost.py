"""`python -m bench.request_cost`'s machinery against the real apiserver, so it cannot rot.
Only outcomes are checked, never timings."""

from __future__ import annotations

import pytest

from devcluster.cluster import LocalCluster
from process.kubeconfig import load_api_client
from tests.support.request_cost import ANNOTATION, CONFIG_MAP, NAMESPACE, measure, report

pytestmark = [pytest.mark.cluster]


def test_every_way_sends_its_requests_and_the_patches_land(
    k8s_cluster: LocalCluster,
) -> None:
    from kubernetes import client

    api = load_api_client(str(k8s_cluster.info.kubeconfig))
    costs = measure(api, requests=3, rounds=2)
    assert [c.way for c in costs] == ["client patch", "pool patch", "pool get"]
    assert all(c.requests == 6 and c.cpu_s > 0 and c.wall_s > 0 for c in costs)
    kept = client.CoreV1Api(api).read_namespaced_config_map(CONFIG_MAP, NAMESPACE)
    # 12 patches after the warm-up, numbered 1..18 with the gets between: the last patch's.
    assert kept.metadata.annotations[ANNOTATION] == "15"
    text = report(costs)
    assert text.splitlines()[1].startswith("client patch")
    assert "client's own layer" in text.splitlines()[-1]
