"""The node finalizer through KubernetesClaimClient: `process.kube.finalizers`, the controller's
way too, and what the preparer is told (`ClaimGoneError`) when the claim is gone.

`VersionedStore` (tests/support/patch_store.py) applies the patches as the apiserver does; the
real apiserver is exercised by test_main.py, the e2e suites and
tests/deploy/test_least_privilege.py (the chart's admission policy for these writes).
"""

from __future__ import annotations

import pytest

from driver.apiobject import Obj
from kubeletplugin.claims import ClaimGoneError, KubernetesClaimClient
from tests.support.patch_store import VersionedStore

MINE = "mig.carve.dev/node-n1"
THEIRS = "mig.carve.dev/allocation"


def _store() -> VersionedStore:
    store = VersionedStore()
    store.add({"metadata": {"name": "c", "namespace": "ns", "uid": "u1", "finalizers": [THEIRS]}})
    return store


def _claim(store: VersionedStore) -> Obj:
    return store.objs[("ns", "c")]


def _client(store: VersionedStore) -> KubernetesClaimClient:
    return KubernetesClaimClient(store)  # type: ignore[arg-type]  # duck-typed KubeJson


def test_an_add_is_one_request_and_keeps_the_controllers_finalizer() -> None:
    """Prepare reads the claim, then adds its finalizer: the add itself needs no read."""
    store = _store()
    store.before_put = lambda cur: store.add(
        {**cur, "metadata": {**cur["metadata"], "finalizers": ["example.com/other"]}}
    )
    _client(store).add_finalizer("ns", "c", "u1", MINE)
    assert _claim(store)["metadata"]["finalizers"] == [MINE, "example.com/other"]
    assert store.kinds == ["application/strategic-merge-patch+json"]


def test_a_removal_takes_only_its_own_entry() -> None:
    store = _store()
    client = _client(store)
    client.add_finalizer("ns", "c", "u1", MINE)
    client.remove_finalizer("ns", "c", "u1", MINE)
    assert _claim(store)["metadata"]["finalizers"] == [THEIRS]
    client.remove_finalizer("ns", "c", "u1", MINE)  # not there: a read, no write
    assert store.kinds == [
        "application/strategic-merge-patch+json",
        "application/json-patch+json",
    ]


def test_a_gone_claim_fails_an_add_and_satisfies_a_remove() -> None:
    store = _store()
    del store.objs[("ns", "c")]
    with pytest.raises(ClaimGoneError, match="no longer exists"):
        _client(store).add_finalizer("ns", "c", "u1", MINE)
    _client(store).remove_finalizer("ns", "c", "u1", MINE)
    store = _store()
    store.before_put = lambda _cur: store.objs.clear()  # deleted between read and write
    _client(store).remove_finalizer("ns", "c", "u1", THEIRS)


def test_a_replaced_claim_is_not_ours() -> None:
    store = _store()
    _claim(store)["metadata"]["uid"] = "u2"
    with pytest.raises(ClaimGoneError, match="UID u1 no longer exists"):
        _client(store).add_finalizer("ns", "c", "u1", MINE)
    _client(store).remove_finalizer("ns", "c", "u1", THEIRS)
    assert _claim(store)["metadata"]["finalizers"] == [THEIRS], "the namesake's is kept"


def test_no_new_finalizer_on_a_claim_being_deleted() -> None:
    store = _store()
    _claim(store)["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    with pytest.raises(ClaimGoneError, match="being deleted"):
        _client(store).add_finalizer("ns", "c", "u1", MINE)
    _client(store).remove_finalizer("ns", "c", "u1", THEIRS)
    assert _claim(store)["metadata"]["finalizers"] == []
