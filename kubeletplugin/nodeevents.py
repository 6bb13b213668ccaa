"""Events on this node's Node object, for what concerns the node rather than one claim (a GPU
turning unhealthy or healthy again): ``kubectl describe node`` and ``kubectl get events``
show them next to the kubelet's own.

Node events live in the ``default`` namespace, as the kubelet's do (a Node has none). They are
events.k8s.io/v1, the API the plugin's ClusterRole grants ``create`` on, and name the Node by
its UID when the plugin could read it (``kubectl describe node`` finds either spelling).
Best effort: a failure is logged, never raised into the caller.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Protocol

from driver.apiviews import ObjectView
from kubeletplugin.claims import plugin_event_writer
from process.kube.jsonclient import JsonRequests

log = logging.getLogger(__name__)

NODE_EVENT_NAMESPACE = "default"


class NodeEvents(Protocol):
    def event(self, *, type_: str, reason: str, message: str, action: str = "GpuHealth") -> None:
        """Post an Event about the node; a failure is logged, not raised."""


class KubernetesNodeEvents:
    """NodeEvents over the apiserver."""

    def __init__(
        self,
        api: JsonRequests,
        *,
        driver: str,
        node: str,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._api = api
        self._writer = plugin_event_writer(api, driver=driver, node=node, clock=clock)
        self._node = node
        self._uid: str | None = None

    def _node_uid(self) -> str:
        if self._uid is None:
            try:
                node = self._api.request("GET", f"/api/v1/nodes/{self._node}")
                self._uid = ObjectView(node).uid or None
            except Exception as e:  # the kubelet's spelling: the node's name as its UID
                log.info("node UID unknown for events", extra={"error": str(e)})
        return self._uid or self._node

    def event(self, *, type_: str, reason: str, message: str, action: str = "GpuHealth") -> None:
        uid = self._node_uid()
        regarding = {"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": uid}
        self._writer.write(
            NODE_EVENT_NAMESPACE,
            regarding,
            type_=type_,
            reason=reason,
            message=message,
            action=action,
        )
