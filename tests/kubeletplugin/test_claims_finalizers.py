"""The node finalizer through KubernetesClaimClient: merge patches guarded by resourceVersion.

`FakeApi` answers the two requests the client makes (GET and a merge-patch PATCH of the claim)
the way the apiserver does: 404 for a missing claim, 409 for a stale resourceVersion. The real
apiserver is exercised by test_main.py and the e2e suites.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from driver.apiobject import Obj
from kubeletplugin.claims import ClaimGoneError, KubernetesClaimClient
from process.kube.errors import api_error

PATH = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c"
MINE = "mig.carve.dev/node-n1"


class FakeApi:
    def __init__(self) -> None:
        self.claim: Obj | None = {
            "metadata": {
                "name": "c",
                "namespace": "ns",
                "uid": "u1",
                "resourceVersion": "5",
                "finalizers": ["mig.carve.dev/allocation"],
            }
        }
        self.patches: list[Obj] = []
        self.gets = 0
        self.before_patch: Callable[[], None] | None = None

    def other_writer(self, finalizers: list[str]) -> None:
        assert self.claim is not None
        meta = self.claim["metadata"]
        meta["finalizers"] = finalizers
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def request(self, method: str, path: str, **kw: Any) -> Obj:
        assert path == PATH
        if method == "GET":
            self.gets += 1
            if self.claim is None:
                raise api_error(404, "not found")
            return copy.deepcopy(self.claim)
        assert method == "PATCH" and kw["content_type"] == "application/merge-patch+json"
        body = kw["body"]
        self.patches.append(copy.deepcopy(body))
        if self.before_patch is not None:
            hook, self.before_patch = self.before_patch, None
            hook()
        if self.claim is None:
            raise api_error(404, "not found")
        if body["metadata"]["resourceVersion"] != self.claim["metadata"]["resourceVersion"]:
            raise api_error(409, "conflict")
        self.other_writer(body["metadata"]["finalizers"])
        return copy.deepcopy(self.claim)


def _client(api: FakeApi) -> KubernetesClaimClient:
    return KubernetesClaimClient(api)  # type: ignore[arg-type]  # duck-typed KubeJson


def test_add_and_remove_write_only_the_finalizers_with_the_version() -> None:
    api = FakeApi()
    _client(api).add_finalizer("ns", "c", "u1", MINE)
    assert api.patches == [
        {"metadata": {"finalizers": ["mig.carve.dev/allocation", MINE], "resourceVersion": "5"}}
    ]
    _client(api).add_finalizer("ns", "c", "u1", MINE)  # already there: no write
    _client(api).remove_finalizer("ns", "c", "u1", MINE)
    assert len(api.patches) == 2
    assert api.claim is not None
    assert api.claim["metadata"]["finalizers"] == ["mig.carve.dev/allocation"]


def test_a_conflict_keeps_the_other_writers_finalizer() -> None:
    api = FakeApi()
    api.before_patch = lambda: api.other_writer([])  # the controller dropped its own meanwhile
    _client(api).add_finalizer("ns", "c", "u1", MINE)
    assert api.claim is not None and api.claim["metadata"]["finalizers"] == [MINE]
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["5", "6"]


def test_a_gone_claim_fails_an_add_and_satisfies_a_remove() -> None:
    api = FakeApi()
    api.claim = None
    with pytest.raises(ClaimGoneError, match="no longer exists"):
        _client(api).add_finalizer("ns", "c", "u1", MINE)
    _client(api).remove_finalizer("ns", "c", "u1", MINE)
    api = FakeApi()
    api.before_patch = lambda: setattr(api, "claim", None)  # deleted between read and write
    _client(api).remove_finalizer("ns", "c", "u1", "mig.carve.dev/allocation")


def test_a_replaced_claim_is_not_ours() -> None:
    api = FakeApi()
    assert api.claim is not None
    api.claim["metadata"]["uid"] = "u2"
    with pytest.raises(ClaimGoneError, match="UID u1 no longer exists"):
        _client(api).add_finalizer("ns", "c", "u1", MINE)
    _client(api).remove_finalizer("ns", "c", "u1", "mig.carve.dev/allocation")
    assert api.patches == []


def test_no_new_finalizer_on_a_claim_being_deleted() -> None:
    api = FakeApi()
    assert api.claim is not None
    api.claim["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    with pytest.raises(ClaimGoneError, match="being deleted"):
        _client(api).add_finalizer("ns", "c", "u1", MINE)
    _client(api).remove_finalizer("ns", "c", "u1", "mig.carve.dev/allocation")
    assert api.claim["metadata"]["finalizers"] == []


def test_adding_after_a_read_derives_the_patch_from_that_read() -> None:
    """Prepare reads the claim, then adds its finalizer: one GET, not two, on its path."""
    api = FakeApi()
    client = _client(api)
    assert client.get("ns", "c") is not None
    client.add_finalizer("ns", "c", "u1", MINE)
    assert api.gets == 1
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["5"]
    client.remove_finalizer("ns", "c", "u1", MINE)  # no copy left: reads again
    assert api.gets == 2


def test_a_stale_read_is_caught_by_its_resource_version() -> None:
    api = FakeApi()
    client = _client(api)
    assert client.get("ns", "c") is not None
    api.other_writer(["someone/else"])  # changed after our read
    client.add_finalizer("ns", "c", "u1", MINE)
    assert api.claim is not None and api.claim["metadata"]["finalizers"] == ["someone/else", MINE]
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["5", "6"]


def test_a_read_of_another_uid_is_not_used() -> None:
    api = FakeApi()
    client = _client(api)
    assert client.get("ns", "c") is not None
    with pytest.raises(ClaimGoneError):
        client.add_finalizer("ns", "c", "u-other", MINE)  # re-read: the name has UID u1
    assert api.patches == []
