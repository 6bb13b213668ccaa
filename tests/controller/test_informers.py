"""The informers' set-up without a cluster (lists and watches against a real apiserver:
tests/controller/cluster/test_informers_cluster.py)."""

from __future__ import annotations

from controller.informers import SLICE_PAGE_SIZE, InformerConfig, standard_informers
from controller.objects import Kind
from tests.support.fake_lists import EmptyLists


def test_resource_slices_are_listed_in_small_pages() -> None:
    """A page of slices is held whole while it is parsed; other kinds keep the usual page."""
    api = EmptyLists()
    informers = standard_informers(api, lambda *_: None, lambda _: None, InformerConfig())
    by_kind = {i.kind: i for i in informers}
    by_kind[Kind.SLICE]._list()
    by_kind[Kind.POD]._list()
    assert [q["limit"] for _, q in api.asked] == [str(SLICE_PAGE_SIZE), "500"]
    small = standard_informers(api, lambda *_: None, lambda _: None, InformerConfig(page_size=20))
    next(i for i in small if i.kind is Kind.SLICE)._list()
    assert api.asked[-1][1]["limit"] == "20"


def test_every_collection_is_listed_through_the_json_client_cluster_wide() -> None:
    """One client for every request: the request counter and the error hierarchy see the
    informers' lists and watches as they see every write."""
    api = EmptyLists()
    for informer in standard_informers(api, lambda *_: None, lambda _: None):
        informer._list()
    assert [path for path, _ in api.asked] == [
        "/api/v1/pods",
        "/api/v1/nodes",
        "/apis/resource.k8s.io/v1/resourceclaims",
        "/apis/resource.k8s.io/v1/resourceslices",
        "/apis/resource.k8s.io/v1/deviceclasses",
        "/apis/resource.k8s.io/v1/devicetaintrules",
    ]
