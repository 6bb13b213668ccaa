"""A Lease as the apiserver keeps it, for the leader-election tests (test_leader.py,
test_handover.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from driver.apiobject import Obj


class LeaseResponse:
    """What the client returns with `_preload_content=False`: the body as bytes."""

    def __init__(self, obj: Obj) -> None:
        self.data = json.dumps(obj).encode()


class LeaseStore:
    """One Lease with the apiserver's optimistic concurrency (409 on a stale
    resourceVersion); `down` makes every call fail with 503."""

    def __init__(self) -> None:
        self.lease: Obj | None = None
        self.rv = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ApiException(status=503, reason="unavailable")

    def read_namespaced_lease(self, name: str, ns: str, **_: Any) -> LeaseResponse:
        self._check()
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        return LeaseResponse(self.lease)

    def create_namespaced_lease(self, ns: str, body: Obj, **_: Any) -> LeaseResponse:
        self._check()
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body)

    def replace_namespaced_lease(self, name: str, ns: str, body: Obj, **_: Any) -> LeaseResponse:
        self._check()
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._store(body)

    def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> Obj:
        """The JSON client's call, as `controller.leader` makes it on one Lease."""
        parts = path.strip("/").split("/")
        ns = parts[parts.index("namespaces") + 1]
        if method == "POST":
            answer = self.create_namespaced_lease(ns, body)
        elif method == "GET":
            answer = self.read_namespaced_lease(parts[-1], ns)
        else:
            assert method == "PUT", (method, path)
            answer = self.replace_namespaced_lease(parts[-1], ns, body)
        result: Obj = json.loads(answer.data)
        return result

    def _store(self, body: Obj) -> LeaseResponse:
        self.rv += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.rv)
        return LeaseResponse(self.lease)
