"""A node that comes back after the controller gave it up as lost (issue 11).

The controller removed the node finalizer of the node's claims and freed their placements; the
claims may since be gone, unallocated, or allocated to another node. The plugin's start-up
reconcile (`Plugin.run`: `reconcile`, then `retry_pending`, then serve and publish) must destroy
the instances of every such checkpointed claim before the node offers its devices again, and
must leave claims still allocated here alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, started_node

H100 = "H100-SXM5-80GB"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with started_node(tmp_path, [H100]) as n:
        yield n


def _restart(node: Node) -> None:
    """A new plugin process on the same hardware and checkpoint, as `Plugin.run` starts."""
    node.start()
    node.p.retry_pending()


def test_claims_no_longer_allocated_here_are_destroyed_at_start_up(node: Node) -> None:
    kept = node.claims.add("kept", [mig(node.backend, 0, 19, 0)])
    unallocated = node.claims.add("unallocated", [mig(node.backend, 0, 19, 1)])
    moved = node.claims.add("moved", [mig(node.backend, 0, 19, 2)])
    gone = node.claims.add("gone", [mig(node.backend, 0, 19, 3)])
    results = node.p.prepare([kept, unallocated, moved, gone])
    assert all(r.error == "" for r in results.values())
    assert len(node.instances()) == 4

    # While the node was away: the controller removed its finalizers and freed the claims.
    fin = next(iter(node.claims.finalizers(kept)))
    for ref in (unallocated, moved, gone):
        node.claims.objects[(ref.namespace, ref.name)]["metadata"]["finalizers"].remove(fin)
    del node.claims.objects[(unallocated.namespace, unallocated.name)]["status"]["allocation"]
    node.claims.objects[(moved.namespace, moved.name)]["status"]["allocation"] = {
        "devices": {
            "results": [{"request": "req0", "driver": DRIVER, "pool": "other-node", "device": "x"}]
        }
    }
    del node.claims.objects[(gone.namespace, gone.name)]

    _restart(node)
    assert node.instances() == [(0, 19, 0, 1)]  # only the claim still allocated here
    assert set(node.p.checkpoint().claims) == {kept.uid}
    assert node.claims.finalizers(kept) == [fin]


def test_a_claim_allocated_here_by_another_driver_only_is_released(node: Node) -> None:
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 0)])
    assert node.p.prepare([ref])[ref.uid].error == ""
    node.claims.objects[(ref.namespace, ref.name)]["status"]["allocation"]["devices"]["results"] = [
        {"request": "req0", "driver": "gpu.example.com", "pool": NODE, "device": "x"}
    ]
    _restart(node)
    assert node.instances() == [] and node.p.checkpoint().claims == {}
    assert node.claims.finalizers(ref) == []


def test_an_unreachable_api_leaves_prepared_claims_alone(node: Node) -> None:
    ref = node.claims.add("c", [mig(node.backend, 0, 19, 0)])
    assert node.p.prepare([ref])[ref.uid].error == ""

    def unreachable(namespace: str, name: str) -> None:
        raise ConnectionError("apiserver unreachable")

    node.claims.get = unreachable  # type: ignore[method-assign,assignment]
    _restart(node)
    assert len(node.instances()) == 1 and ref.uid in node.p.checkpoint().claims
