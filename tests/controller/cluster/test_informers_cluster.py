"""Informers against the real kube-apiserver: paginated list, watch, expiry and relist, stop.

Expiry (410 Gone) is injected at the next watch event, because a fresh test apiserver has not
compacted etcd and still serves old revisions.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from controller.informers import Informer, InformerConfig, _ExpiredError
from controller.reconciler import EventType, Kind
from devcluster.waiting import wait_for
from tests.controller.cluster.objects import template

pytestmark = pytest.mark.cluster

Obj = dict[str, Any]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[EventType, str]] = []
        self.synced: list[Kind] = []
        self.lock = threading.Lock()

    def handler(self, kind: Kind, type_: EventType, obj: Obj) -> None:
        with self.lock:
            self.events.append((type_, obj["metadata"]["name"]))

    def seen(self, type_: EventType, name: str) -> bool:
        with self.lock:
            return (type_, name) in self.events


def _claim(name: str) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": template("x")["spec"]["spec"],
    }


def test_list_then_watch_then_relist_after_expiry(k8s_api: ApiClient, namespace: str) -> None:
    res = client.ResourceV1Api(k8s_api)
    res.create_namespaced_resource_claim(namespace, _claim("before"))

    def list_claims(**kw: Any) -> Any:
        return res.list_namespaced_resource_claim(namespace, **kw)

    rec = Recorder()
    inf = Informer(
        Kind.CLAIM,
        list_claims,
        rec.handler,
        rec.synced.append,
        InformerConfig(page_size=1, watch_timeout_s=2, resync_period_s=3600),
    )
    t = threading.Thread(target=inf.run, args=(time.monotonic,), daemon=True)
    t.start()
    try:
        wait_for("initial sync", lambda: rec.synced == [Kind.CLAIM])
        assert rec.seen(EventType.ADDED, "before")
        res.create_namespaced_resource_claim(namespace, _claim("during"))
        wait_for("watch ADDED", lambda: rec.seen(EventType.ADDED, "during"))
        res.delete_namespaced_resource_claim("before", namespace)
        wait_for("watch DELETED", lambda: rec.seen(EventType.DELETED, "before"))
        assert set(inf.cache) == {f"{namespace}/during"}
        relists = inf.relists
        # An expired resourceVersion (410 Gone) makes the informer relist and diff.
        with inf._lock:
            inf.cache[f"{namespace}/ghost"] = {
                "metadata": {"name": "ghost", "namespace": namespace}
            }
        expired = inf._on_watch_event  # keep a handle; force expiry on the next event

        def expire(event: Obj, rv: str) -> str:
            inf._on_watch_event = expired  # type: ignore[method-assign]
            raise _ExpiredError()

        inf._on_watch_event = expire  # type: ignore[method-assign]
        res.create_namespaced_resource_claim(namespace, _claim("after"))
        wait_for("relist", lambda: inf.relists > relists)
        wait_for("ghost removed by the relist diff", lambda: rec.seen(EventType.DELETED, "ghost"))
        wait_for("after seen", lambda: rec.seen(EventType.ADDED, "after"))
        assert set(inf.cache) == {f"{namespace}/during", f"{namespace}/after"}
        assert rec.synced == [Kind.CLAIM]  # synced is reported once
    finally:
        inf.stop()
        t.join(10)
    assert not t.is_alive()
