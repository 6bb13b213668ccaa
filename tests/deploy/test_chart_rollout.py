"""The chart's hygiene for a rolling world (issue 42.4), rendered by the real helm: the
controller's PodDisruptionBudget (only where it cannot block a drain), anti-affinity and
topology spread; the plugin DaemonSet's rolling update, priority and resources; and the skew
policy's plumbing (the plugin told where the controller's Lease is, allowed to read that one)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.helm import CHART, Helm, by_kind, one

ANTI_AFFINITY = {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {
            "weight": 100,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "carve-controller",
                        "app.kubernetes.io/instance": "carve",
                    }
                },
            },
        }
    ]
}


def _controller_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment", "carve-controller")["spec"]["template"]["spec"]
    return spec


def test_two_controller_replicas_get_a_budget_that_lets_a_drain_through(helm: Helm) -> None:
    docs = helm.template()
    pdb = one(docs, "PodDisruptionBudget", "carve-controller")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["metadata"]["namespace"] == "carve-system"
    assert pdb["spec"]["minAvailable"] == 1
    deployment = one(docs, "Deployment", "carve-controller")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert one(helm.template("controller.replicas=3"), "PodDisruptionBudget")["spec"] == pdb["spec"]


@pytest.mark.parametrize(
    "sets", [("controller.replicas=1",), ("controller.podDisruptionBudget.enabled=false",)]
)
def test_no_budget_for_one_replica_or_when_off(helm: Helm, sets: tuple[str, ...]) -> None:
    """minAvailable 1 of 1 replica would block every drain of its node."""
    assert by_kind(helm.template(*sets), "PodDisruptionBudget") == []


def test_a_budget_that_would_block_every_drain_is_refused(helm: Helm) -> None:
    done = helm.run(
        "template", "carve", str(CHART), "--set", "controller.podDisruptionBudget.minAvailable=2",
        check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "controller.podDisruptionBudget.minAvailable=2 with controller.replicas=2 would block "
        "every node drain"
    ) in done.stderr


def test_controller_replicas_prefer_different_nodes_and_spread_over_zones(helm: Helm) -> None:
    pod = _controller_pod(helm.template())
    assert pod["affinity"] == {"podAntiAffinity": ANTI_AFFINITY}
    (spread,) = pod["topologySpreadConstraints"]
    assert spread == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": ANTI_AFFINITY["preferredDuringSchedulingIgnoredDuringExecution"][0][
            "podAffinityTerm"
        ]["labelSelector"],
        "matchLabelKeys": ["pod-template-hash"],
    }
    off = _controller_pod(
        helm.template("controller.podAntiAffinity=none", "controller.topologySpread.enabled=false")
    )
    assert "affinity" not in off and "topologySpreadConstraints" not in off


def test_the_operators_affinity_is_kept_and_its_own_anti_affinity_wins(helm: Helm) -> None:
    node_affinity = "controller.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0]"  # noqa: E501
    pod = _controller_pod(
        helm.template(
            f"{node_affinity}.key=pool",
            f"{node_affinity}.operator=In",
            f"{node_affinity}.values[0]=system",
        )
    )
    assert set(pod["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    assert pod["affinity"]["podAntiAffinity"] == ANTI_AFFINITY
    theirs = _controller_pod(
        helm.template(
            "controller.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey=zone"
        )
    )
    assert list(theirs["affinity"]["podAntiAffinity"]) == [
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]


def test_the_plugin_rolls_one_node_at_a_time_as_a_node_critical_pod_with_resources(
    helm: Helm,
) -> None:
    daemonset = one(helm.template(), "DaemonSet", "carve-kubelet-plugin")
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    (container,) = [c for c in pod["containers"] if c["name"] == "plugin"]
    assert container["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "512Mi"},
    }
    percent = one(helm.template("plugin.maxUnavailable=10%"), "DaemonSet")
    assert percent["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"


def test_the_plugin_reads_the_controllers_lease_and_only_that_one(helm: Helm) -> None:
    docs = helm.template()
    env = one(docs, "ConfigMap", "carve-kubelet-plugin")["data"]
    assert env["CARVE_CONTROLLER_LEASE"] == "carve-system/carve-controller"
    role = one(docs, "Role", "carve-kubelet-plugin-controller-lease")
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["carve-controller"],
            "verbs": ["get"],
        }
    ]
    binding = one(docs, "RoleBinding", "carve-kubelet-plugin-controller-lease")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "carve-kubelet-plugin", "namespace": "carve-system"}
    ]
    single = helm.template("controller.replicas=1")  # no leader election, so no Lease
    assert "CARVE_CONTROLLER_LEASE" not in one(single, "ConfigMap", "carve-kubelet-plugin")["data"]
    roles = {r["metadata"]["name"] for r in by_kind(single, "Role")}
    assert "carve-kubelet-plugin-controller-lease" not in roles
