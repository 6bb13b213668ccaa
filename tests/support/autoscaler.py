"""Cluster Autoscaler's own test of a pending pod, for the suites that check carve's hint
(tests/controller/test_autoscaler_hint.py, tests/controller/cluster/test_autoscaler_cluster.py).

kubernetes/autoscaler, cluster-autoscaler/utils/kubernetes/listers.go, `isUnschedulable`: a
pod counts as unschedulable (and CA simulates a scale-up for it) when it is not scheduled
(`spec.nodeName` empty), not being deleted, and `podv1.GetPodCondition(&pod.Status,
PodScheduled)` (the first condition of that type) has `Status == ConditionFalse` and
`Reason == PodReasonUnschedulable` ("Unschedulable"). CA never reads `spec.schedulingGates`.
This is that check, word for word, on an API-shaped pod.
"""

from __future__ import annotations

from typing import Any


def ca_sees_unschedulable(pod: dict[str, Any]) -> bool:
    """`isUnschedulable` of cluster-autoscaler/utils/kubernetes/listers.go (see the module)."""
    if (pod.get("spec") or {}).get("nodeName") or (pod.get("metadata") or {}).get(
        "deletionTimestamp"
    ):
        return False
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":  # GetPodCondition: the first of the type
            return cond.get("status") == "False" and cond.get("reason") == "Unschedulable"
    return False


def pod_scheduled(pod: dict[str, Any]) -> dict[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled":
            return dict(cond)
    return None
