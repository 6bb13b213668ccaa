from __future__ import annotations

from typing import Any

import pytest

from controller.nodefit import (
    MisfitReason,
    NodeInfo,
    PodNeeds,
    PodSpecError,
    Resources,
    Taint,
    TaintEffect,
    check_node,
    parse_node,
    parse_pod_needs,
)
from controller.tolerations import Toleration

NODE = NodeInfo(
    "n1",
    Resources(4000, 16 * 2**30, 10),
    labels=(("gpu", "h100"), ("kubernetes.io/hostname", "n1"), ("rank", "5")),
)


def pod(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]
    }
    base.update(spec)
    return {"metadata": {"name": "p"}, "spec": base}


NOTHING_USED = Resources()


def reason(
    needs: PodNeeds, node: NodeInfo = NODE, used: Resources = NOTHING_USED
) -> MisfitReason | None:
    misfit = check_node(needs, node, used)
    return None if misfit is None else misfit.reason


def test_fits_plain_node() -> None:
    assert reason(parse_pod_needs(pod())) is None


def test_ready_and_cordon() -> None:
    needs = parse_pod_needs(pod())
    assert reason(needs, NodeInfo("n", NODE.allocatable, ready=False)) is MisfitReason.NOT_READY
    assert (
        reason(needs, NodeInfo("n", NODE.allocatable, unschedulable=True))
        is MisfitReason.UNSCHEDULABLE
    )


@pytest.mark.parametrize(
    ("effect", "tolerations", "fits"),
    [
        (TaintEffect.NO_SCHEDULE, [], False),
        (TaintEffect.NO_EXECUTE, [], False),
        (TaintEffect.PREFER_NO_SCHEDULE, [], True),
        (TaintEffect.NO_SCHEDULE, [{"key": "k", "operator": "Equal", "value": "v"}], True),
        (TaintEffect.NO_SCHEDULE, [{"key": "k", "operator": "Equal", "value": "w"}], False),
        (TaintEffect.NO_SCHEDULE, [{"key": "k", "operator": "Exists"}], True),
        (TaintEffect.NO_SCHEDULE, [{"operator": "Exists"}], True),
        (
            TaintEffect.NO_SCHEDULE,
            [{"key": "k", "operator": "Exists", "effect": "NoExecute"}],
            False,
        ),
    ],
)
def test_taints_and_tolerations(
    effect: TaintEffect, tolerations: list[dict[str, str]], fits: bool
) -> None:
    node = NodeInfo("n", NODE.allocatable, taints=(Taint("k", "v", effect),))
    needs = parse_pod_needs(pod(tolerations=tolerations))
    assert (reason(needs, node) is None) is fits


def affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


@pytest.mark.parametrize(
    ("terms", "fits"),
    [
        (
            [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "a100"]}]}],
            True,
        ),
        ([{"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["h100"]}]}], False),
        ([{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}], True),
        ([{"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}], False),
        ([{"matchExpressions": [{"key": "rank", "operator": "Gt", "values": ["4"]}]}], True),
        ([{"matchExpressions": [{"key": "rank", "operator": "Lt", "values": ["4"]}]}], False),
        ([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}], True),
        ([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}], False),
        (
            [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]},
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
            ],
            True,  # terms are ORed
        ),
        ([{}], False),  # an empty term matches nothing
    ],
)
def test_required_node_affinity(terms: list[dict[str, Any]], fits: bool) -> None:
    needs = parse_pod_needs(pod(affinity=affinity(*terms)))
    assert (reason(needs) is None) is fits
    if not fits:
        assert reason(needs) is MisfitReason.AFFINITY


def test_node_selector() -> None:
    assert reason(parse_pod_needs(pod(nodeSelector={"gpu": "h100"}))) is None
    assert reason(parse_pod_needs(pod(nodeSelector={"gpu": "a100"}))) is MisfitReason.NODE_SELECTOR


def test_resources_against_allocatable_minus_usage() -> None:
    needs = parse_pod_needs(pod())
    assert reason(needs, used=Resources(3500, 0, 0)) is None
    assert reason(needs, used=Resources(3501, 0, 0)) is MisfitReason.CPU
    assert reason(needs, used=Resources(0, 15 * 2**30 + 1, 0)) is MisfitReason.MEMORY
    assert reason(needs, used=Resources(0, 0, 10)) is MisfitReason.PODS
    misfit = check_node(needs, NODE, Resources(3800, 0, 0))
    assert misfit is not None and misfit.message == (
        "node n1: insufficient cpu (requested 500m, free 200m)"
    )


def test_effective_requests_include_init_containers_sidecars_and_overhead() -> None:
    needs = parse_pod_needs(
        pod(
            initContainers=[
                {"name": "init", "resources": {"requests": {"cpu": "2", "memory": "100Mi"}}},
                {
                    "name": "sidecar",
                    "restartPolicy": "Always",
                    "resources": {"requests": {"cpu": "100m"}},
                },
            ],
            overhead={"cpu": "10m"},
        )
    )
    # max(500m + 100m sidecar, 2000m init) + 10m overhead; memory max(1Gi, 100Mi).
    assert needs.requests == Resources(2010, 2**30, 1)


def test_parse_node_and_errors() -> None:
    node = parse_node(
        {
            "metadata": {"name": "n", "labels": {"a": "b"}},
            "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )
    assert node.allocatable == Resources(8000, 32 * 2**30, 110)
    assert node.ready and node.unschedulable and node.label("a") == "b"
    assert node.taints == (Taint("k", "", TaintEffect.NO_SCHEDULE),)
    with pytest.raises(PodSpecError, match=r"spec.taints\[0\].effect"):
        parse_node({"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}})
    with pytest.raises(PodSpecError, match=r"spec.containers\[0\].resources.requests.cpu"):
        parse_pod_needs(pod(containers=[{"resources": {"requests": {"cpu": "lots"}}}]))
    with pytest.raises(PodSpecError, match="operator"):
        parse_pod_needs(
            pod(affinity=affinity({"matchExpressions": [{"key": "a", "operator": "Near"}]}))
        )
    assert Toleration("", "Exists", "", "").tolerates(Taint("x", "y", TaintEffect.NO_EXECUTE))
