"""Events on pods and claims, so `kubectl describe` tells users what carve decided and why.

Events are written with events.k8s.io/v1 (the same storage `kubectl describe` reads). They are
best effort: a failed event write is logged and never blocks or fails an allocation. Repeats of
the same (object, reason, message) are folded into one Event whose `series` count grows, as
client-go's recorder does, so a pod that waits for an hour yields one event, not hundreds.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from controller.objects import Kind
from controller.status import discard_response
from driver.contract import DEFAULT_CONTRACT
from process.kube import Obj
from process.kube.errors import status_of

_log = logging.getLogger(__name__)

_MAX_TRACKED = 10_000

_API_VERSIONS = {
    Kind.POD: "v1",
    Kind.CLAIM: "resource.k8s.io/v1",
}


def _micro(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(
    obj: Obj,
    kind: Kind,
    type_: str,
    reason: str,
    message: str,
    *,
    controller: str,
    instance: str,
    now: dt.datetime,
) -> Obj:
    """An events.k8s.io/v1 Event about `obj`. The name is stable per (object, reason, message)."""
    meta = obj.get("metadata", {})
    digest = hashlib.sha1(f"{reason}\0{message}".encode(), usedforsecurity=False).hexdigest()[:10]
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta.get('name')}.{digest}"[:253],
            "namespace": meta.get("namespace", "default"),
        },
        "eventTime": _micro(now),
        "reportingController": controller,
        "reportingInstance": instance,
        "action": "Allocate" if kind is Kind.CLAIM else "Place",
        "reason": reason,
        "note": message[:1024],
        "type": type_,
        "regarding": {
            "apiVersion": _API_VERSIONS.get(kind, "v1"),
            "kind": str(kind),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
    }


class KubeRecorder:
    """`Recorder` writing to the apiserver through `EventsV1Api`."""

    def __init__(
        self,
        events_api: Any,
        *,
        controller: str = DEFAULT_CONTRACT.event_source,
        instance: str = "carve-controller",
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._api = events_api
        self._controller = controller
        self._instance = instance
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], int] = {}

    def event(self, obj: Obj, kind: Kind, type_: str, reason: str, message: str) -> None:
        now = self._clock()
        body = event_body(
            obj,
            kind,
            type_,
            reason,
            message,
            controller=self._controller,
            instance=self._instance,
            now=now,
        )
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        with self._lock:
            if len(self._series) > _MAX_TRACKED:
                self._series.clear()
            count = self._series.get((ns, name), 0) + 1
            self._series[(ns, name)] = count
        try:
            if count == 1:
                try:
                    discard_response(
                        self._api.create_namespaced_event(ns, body, _preload_content=False)
                    )
                    return
                except Exception as exc:
                    if status_of(exc) != 409:
                        raise
                    count = 2
            patch = {"series": {"count": count, "lastObservedTime": _micro(now)}}
            discard_response(
                self._api.patch_namespaced_event(name, ns, patch, _preload_content=False)
            )
        except Exception as exc:
            if status_of(exc) == 403 and "NamespaceTerminating" in str(
                getattr(exc, "body", "") or ""
            ):
                # Nobody will read it: the namespace and the object are going away.
                _log.debug("not recording event %s in terminating namespace %s", reason, ns)
                return
            _log.warning("could not record event %s on %s/%s: %s", reason, ns, name, exc)
