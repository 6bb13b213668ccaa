from __future__ import annotations

from typing import Any

import pytest

from kubeletplugin.publisher import _content_hash, parse_server_version, uses_split_counters


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ({"major": "1", "minor": "37"}, (1, 37)),
        ({"major": "1", "minor": "35+"}, (1, 35)),
        ({"major": "", "minor": "", "gitVersion": "v1.34.2-gke.1"}, (1, 34)),
    ],
)
def test_server_version(version: dict[str, str], expected: tuple[int, int]) -> None:
    assert parse_server_version(version) == expected


def test_server_version_garbage() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_server_version({"major": "x"})


def test_split_from_135() -> None:
    assert not uses_split_counters((1, 34))
    assert uses_split_counters((1, 35))
    assert uses_split_counters((2, 0))


def test_content_hash_ignores_generation_only() -> None:
    a = {"pool": {"name": "n", "generation": 1, "resourceSliceCount": 2}, "devices": [1]}
    b = {"pool": {"name": "n", "generation": 9, "resourceSliceCount": 2}, "devices": [1]}
    c = {"pool": {"name": "n", "generation": 1, "resourceSliceCount": 2}, "devices": [2]}
    assert _content_hash(a) == _content_hash(b) != _content_hash(c)


# --- convergence against the real kube-apiserver ------------------------------------------


@pytest.mark.cluster
def test_converges_bumps_generation_and_cleans_up(k8s_api: Any, fake_node: Any) -> None:
    from driver.catalog import CATALOG
    from driver.resourceslice import PublishedGpu, build_resource_slices
    from kubeletplugin.claims import KubeJson
    from kubeletplugin.publisher import SLICES_PATH, PublisherSettings, SlicePublisher

    node = fake_node()
    api = KubeJson(k8s_api)
    gpus = [
        PublishedGpu(m, f"GPU-{m}-{node}", CATALOG["A100-SXM4-40GB"], f"0000:0{m}:00.0", "580.1")
        for m in range(3)
    ]
    inventory = list(gpus)

    def build(generation: int, split: bool) -> list[dict[str, object]]:
        return build_resource_slices(
            driver="mig.carve.dev",
            node_name=node,
            pool_generation=generation,
            gpus=inventory,
            split_counters=split,
        )

    pub = SlicePublisher(PublisherSettings("mig.carve.dev", node), api, build)
    assert pub.split_counters()  # the dev cluster is 1.37
    assert pub.sync() is True
    first = pub.existing()
    assert len(first) == 6  # counters + devices per GPU
    assert {s["spec"]["pool"]["generation"] for s in first} == {1}
    assert all(s["metadata"]["ownerReferences"][0]["kind"] == "Node" for s in first)
    assert pub.sync() is False  # converged: no writes, no generation churn
    assert [s["metadata"]["resourceVersion"] for s in pub.existing()] == [
        s["metadata"]["resourceVersion"] for s in first
    ]

    inventory.pop()  # a GPU disappears (e.g. refused): its slices go, the generation moves
    assert pub.sync() is True
    second = pub.existing()
    assert len(second) == 4
    assert {s["spec"]["pool"]["generation"] for s in second} == {2}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in second} == {4}

    api.request("DELETE", f"{SLICES_PATH}/{second[0]['metadata']['name']}")  # partial wipe
    assert pub.sync() is True
    assert len(pub.existing()) == 4
    assert {s["spec"]["pool"]["generation"] for s in pub.existing()} == {3}

    assert pub.cleanup() == 4
    assert pub.existing() == []
