"""When a GPU node counts as lost, and what that allows the controller to do with its claims.

Three signals, from strongest to weakest (docs/controller.md, "Lost nodes"):

- ``deleted``: the Node object is gone (an admin or the cloud provider removed the machine);
- ``out-of-service``: the node carries the taint ``node.kubernetes.io/out-of-service`` (any
  effect), Kubernetes' signal of a non-graceful shutdown: an admin asserts that the node is off
  and its workloads stopped;
- ``not-ready``: its Ready condition has been False or Unknown for longer than
  ``--node-loss-grace``.

A lost node gets no new placements. Claims allocated there but not yet prepared (no node
finalizer: the plugin adds it before it carves) hold no instance, so their allocation can be
cleared and their unbound pods re-planned under any signal. Claims the node has prepared (node
finalizer present) are treated as destroyed only on a *strong* signal (deleted, out-of-service):
then the node finalizer is removed on the node's behalf. NotReady alone never frees a prepared
placement, because an unreachable node may well still run the pod and hold the instance.

Pure functions over API objects; `controller.nodehealth.lost` owns the decisions. What the
informer keeps of a Node (`controller.cache.trim_node`) is what these functions read.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.nodefit import OUT_OF_SERVICE_TAINT
from driver.apiviews import NodeView


class LossSignal(enum.StrEnum):
    DELETED = "deleted"
    OUT_OF_SERVICE = "out-of-service"
    NOT_READY = "not-ready"

    @property
    def strong(self) -> bool:
        """Someone asserts the node's workloads are stopped: its instances may be reused."""
        return self is not LossSignal.NOT_READY


@dataclass(frozen=True)
class NodeLoss:
    node: str
    signal: LossSignal
    detail: str

    @property
    def strong(self) -> bool:
        return self.signal.strong

    def describe(self) -> str:
        return f"node {self.node} is lost ({self.detail})"


def _parse_time(value: object) -> dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def node_loss(
    name: str,
    node: Mapping[str, Any] | None,
    now: dt.datetime,
    grace: float | None,
) -> NodeLoss | None:
    """Whether node ``name`` (its Node object, None when there is none) is lost at ``now``.

    ``grace`` is ``--node-loss-grace`` in seconds; None or 0 disables the NotReady signal.
    A Ready condition that is missing or has no parseable ``lastTransitionTime`` never starts
    the NotReady clock: carve does not guess how long a node has been down.
    """
    if node is None:
        return NodeLoss(name, LossSignal.DELETED, "its Node object was deleted")
    view = NodeView(node)
    for taint in view.taints:
        if taint.get("key") == OUT_OF_SERVICE_TAINT:
            effect = taint.get("effect") or "?"
            return NodeLoss(
                name,
                LossSignal.OUT_OF_SERVICE,
                f"it carries the taint {OUT_OF_SERVICE_TAINT}:{effect}",
            )
    if not grace:
        return None
    ready = view.condition("Ready")
    if ready is None or ready.get("status") == "True":
        return None
    since = _parse_time(ready.get("lastTransitionTime"))
    if since is None:
        return None
    down = (now - since).total_seconds()
    if down > grace:
        return NodeLoss(
            name,
            LossSignal.NOT_READY,
            f"Ready has been {ready.get('status')} for {down:.0f}s, "
            f"longer than --node-loss-grace={grace:.0f}s",
        )
    return None


def not_ready_deadline(node: Mapping[str, Any], grace: float | None) -> dt.datetime | None:
    """When a NotReady node will count as lost (None: it is Ready, or the signal is off)."""
    if not grace:
        return None
    ready = NodeView(node).condition("Ready")
    if ready is None or ready.get("status") == "True":
        return None
    since = _parse_time(ready.get("lastTransitionTime"))
    return None if since is None else since + dt.timedelta(seconds=grace)
