"""The one writer of Events, for both programs: what users read with `kubectl describe`.

Events are events.k8s.io/v1: the storage `kubectl describe` reads, and the API both programs'
ClusterRoles grant. They are best effort: a failed write is logged and never raised into the
caller, so an event can neither block nor fail an allocation or a prepare.

Repeats fold into one Event whose `series` count grows, as client-go's recorder does: the
Event's name is stable per (object, reason, message, reporter), the first is created and
each repeat patches its `series`. The controller always worked this way; the node plugin
used to post a new randomly named Event each time, so a claim whose prepare the kubelet
retried for an hour left hundreds. Folding is the better rule for both: one line with a count
in `kubectl describe`, one object in etcd.

The object's UID is part of the name, so an object deleted and created again under the same
name gets its own Event rather than a count on the old one's. A refusal because the namespace
is being deleted is dropped quietly: nobody will read the event, and a lost node's leftover
claims often sit in such namespaces.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from process.kube import Obj
from process.kube.errors import ConflictError, status_of
from process.kube.jsonclient import JsonRequests
from process.kube.rmw import MERGE_PATCH

_log = logging.getLogger(__name__)

MAX_TRACKED = 10_000
"""Series remembered at once; past it the memory starts again (a repeat then patches the
existing Event from a count of 2, as after a restart)."""


def micro_time(now: dt.datetime) -> str:
    """A MicroTime as the API writes it (`eventTime`, `series.lastObservedTime`)."""
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def regarding_of(obj: Obj, api_version: str, kind: str) -> dict[str, Any]:
    """The `regarding` reference to an object as the API served it."""
    meta = obj.get("metadata", {})
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }


def event_name(regarding: Mapping[str, Any], reason: str, message: str, reporter: str) -> str:
    """The Event's name: stable per (object, reason, message, reporter), so repeats fold."""
    key = "\0".join(str(regarding.get(k) or "") for k in ("kind", "namespace", "name", "uid"))
    digest = hashlib.sha1(
        f"{key}\0{reporter}\0{reason}\0{message}".encode(), usedforsecurity=False
    ).hexdigest()[:10]
    return f"{regarding.get('name')}.{digest}"[:253]


def event_body(
    namespace: str,
    regarding: Mapping[str, Any],
    *,
    type_: str,
    reason: str,
    message: str,
    action: str,
    controller: str,
    instance: str,
    now: dt.datetime,
) -> Obj:
    """An events.k8s.io/v1 Event about `regarding`, reported by `controller`/`instance`."""
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(regarding, reason, message, f"{controller}\0{instance}"),
            "namespace": namespace,
        },
        "eventTime": micro_time(now),
        "reportingController": controller,
        "reportingInstance": instance[:128],
        "action": action,
        "reason": reason,
        "note": message[:1024],
        "type": type_,
        "regarding": dict(regarding),
    }


def _events_path(namespace: str) -> str:
    return f"/apis/events.k8s.io/v1/namespaces/{namespace}/events"


def _namespace_terminating(exc: BaseException) -> bool:
    return status_of(exc) == 403 and "NamespaceTerminating" in str(getattr(exc, "body", "") or "")


class EventWriter:
    """Writes Events for one reporter (`controller`, `instance`) through the JSON client."""

    def __init__(
        self,
        api: JsonRequests,
        *,
        controller: str,
        instance: str,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._api = api
        self._controller = controller
        self._instance = instance
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], int] = {}

    def write(
        self,
        namespace: str,
        regarding: Mapping[str, Any],
        *,
        type_: str,
        reason: str,
        message: str,
        action: str,
    ) -> None:
        """Post the Event, or count a repeat of it; a failure is logged, never raised."""
        now = self._clock()
        body = event_body(
            namespace,
            regarding,
            type_=type_,
            reason=reason,
            message=message,
            action=action,
            controller=self._controller,
            instance=self._instance,
            now=now,
        )
        name = body["metadata"]["name"]
        with self._lock:
            if len(self._series) > MAX_TRACKED:
                self._series.clear()
            count = self._series.get((namespace, name), 0) + 1
            self._series[(namespace, name)] = count
        try:
            self._send(namespace, name, body, count, now)
        except Exception as exc:
            if _namespace_terminating(exc):
                _log.debug("not posting event %s in terminating namespace %s", reason, namespace)
                return
            _log.warning(
                "could not post event %s on %s %s/%s: %s",
                reason,
                regarding.get("kind"),
                namespace,
                regarding.get("name"),
                exc,
            )

    def _send(self, namespace: str, name: str, body: Obj, count: int, now: dt.datetime) -> None:
        if count == 1:
            try:
                self._api.request("POST", _events_path(namespace), body=body)
                return
            except ConflictError:
                count = 2  # written before this process remembered it (a restart)
        patch = {"series": {"count": count, "lastObservedTime": micro_time(now)}}
        self._api.request(
            "PATCH", f"{_events_path(namespace)}/{name}", body=patch, content_type=MERGE_PATCH
        )
