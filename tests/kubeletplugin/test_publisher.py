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
    from kubeletplugin.publisher import SLICES_PATH, PublisherSettings, SlicePublisher
    from process.kube.jsonclient import KubeJson

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


@pytest.mark.cluster
def test_two_machines_with_one_node_name_do_not_fight_over_its_slices(
    k8s_api: Any, fake_node: Any
) -> None:
    """Two plugins publish for one node name, each with its own GPUs: the one whose slices were
    rewritten stops, says why (readyz, a Node event), and resumes once the other's are gone; a
    restarted plugin (a new process) takes its predecessor's slices over without a conflict."""
    from driver.catalog import CATALOG
    from driver.resourceslice import PublishedGpu, build_resource_slices
    from kubeletplugin.publisher import SLICES_PATH, PublisherSettings, SlicePublisher
    from process.kube.jsonclient import KubeJson

    node = fake_node()
    api = KubeJson(k8s_api)

    def publisher(machine: str) -> SlicePublisher:
        gpus = [PublishedGpu(0, f"GPU-{machine}", CATALOG["A100-SXM4-40GB"], "0000:07:00.0", "1")]
        return SlicePublisher(
            PublisherSettings("mig.carve.dev", node),
            api,
            lambda g, s: build_resource_slices(
                driver="mig.carve.dev", node_name=node, pool_generation=g, gpus=gpus,
                split_counters=s,
            ),
        )  # fmt: skip

    def uuids() -> set[str]:
        return {
            d["attributes"]["uuid"]["string"]
            for s in a.existing()
            for d in s["spec"].get("devices") or []
            if "uuid" in d.get("attributes", {})
        }

    a, b = publisher("a"), publisher("b")
    told: list[str] = []
    a.on_conflict = told.append
    assert a.sync() is True and uuids() == {"GPU-a"}
    restarted = publisher("a")  # the same machine, a new process: no conflict, it takes over
    assert restarted.sync() is True and restarted.conflict == ""
    assert a.sync() is False and a.conflict  # but the old process, were it alive, would see one
    a = publisher("a")
    a.on_conflict = told.append
    told.clear()
    assert a.sync() is True
    assert b.sync() is True and uuids() == {"GPU-b"}  # b takes the slices over, as a new process
    assert a.sync() is False and uuids() == {"GPU-b"}  # a sees its slices rewritten: it stops
    assert "two machines run with the node name" in a.conflict and node in a.conflict
    assert told == [a.conflict]
    assert a.sync() is False and told == [a.conflict]  # said once, still not writing
    for s in b.existing():  # b's machine goes away; the kubelet deletes its slices
        api.request("DELETE", f"{SLICES_PATH}/{s['metadata']['name']}")
    assert a.sync() is True and a.conflict == "" and uuids() == {"GPU-a"}
    assert a.cleanup() > 0
