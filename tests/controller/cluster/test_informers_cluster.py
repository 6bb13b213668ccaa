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

from controller.informers import Informer, InformerConfig
from controller.objects import EventType, Kind
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from process.kube.errors import GoneError
from process.kube.jsonclient import KubeJson
from process.kube.listwatch import JsonCollection
from tests.controller.cluster.objects import template

pytestmark = pytest.mark.cluster


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

    rec = Recorder()
    inf = Informer(
        Kind.CLAIM,
        JsonCollection(
            KubeJson(k8s_api), f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
        ),
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
        changed = inf.changed  # keep a handle; force expiry on the next event

        def expire(type_: str, obj: Obj) -> None:
            inf.changed = changed  # type: ignore[method-assign]
            raise GoneError(410, "too old resource version")

        inf.changed = expire  # type: ignore[method-assign]
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


def _pod(name: str, **spec: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "x"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "registry.invalid/x",
                    "resources": {"requests": {"cpu": "100m"}},
                }
            ],
            **spec,
        },
    }


def test_pod_view_caches_only_what_the_controller_needs(
    k8s_api: ApiClient,
    namespace: str,
    fake_node: Any,
) -> None:
    """Unbound pods without claims are not cached; once bound they are, trimmed; a pod that
    leaves the view (it ended) is delivered as DELETED; a label change to a trimmed pod
    changes nothing kept and is skipped."""
    from controller.cache import pod_view

    core = client.CoreV1Api(k8s_api)
    node = fake_node()
    rec = Recorder()
    inf = Informer(
        Kind.POD,
        JsonCollection(KubeJson(k8s_api), f"/api/v1/namespaces/{namespace}/pods"),
        rec.handler,
        rec.synced.append,
        InformerConfig(watch_timeout_s=5),
        transform=pod_view("mig.carve.dev/placement", "mig.carve.dev"),
        skip_unchanged=True,
    )
    # No node matches: kube-scheduler leaves it unbound.
    core.create_namespaced_pod(namespace, _pod("unbound", nodeSelector={"carve.test/none": "x"}))
    t = threading.Thread(target=inf.run, args=(time.monotonic,), daemon=True)
    t.start()
    try:
        wait_for("initial sync", lambda: rec.synced == [Kind.POD])
        core.create_namespaced_pod(namespace, _pod("bound", nodeName=node))
        wait_for("the bound pod", lambda: rec.seen(EventType.ADDED, "bound"))
        assert set(inf.cache) == {f"{namespace}/bound"}, "the unbound plain pod is not kept"
        kept = inf.cache[f"{namespace}/bound"]
        assert kept["spec"]["nodeName"] == node and "labels" not in kept["metadata"]
        skipped = inf.skipped
        core.patch_namespaced_pod("bound", namespace, {"metadata": {"labels": {"app": "y"}}})
        wait_for("the label change to be skipped", lambda: inf.skipped > skipped)
        assert not rec.seen(EventType.MODIFIED, "bound")
        core.patch_namespaced_pod_status("bound", namespace, {"status": {"phase": "Succeeded"}})
        wait_for("the ended pod to leave", lambda: rec.seen(EventType.DELETED, "bound"))
        assert inf.cache == {}
    finally:
        inf.stop()
        t.join(10)
