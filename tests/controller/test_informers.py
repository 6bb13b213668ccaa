"""The informers' set-up without a cluster (lists and watches against a real apiserver:
tests/controller/cluster/test_informers_cluster.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from controller.informers import SLICE_PAGE_SIZE, InformerConfig, standard_informers
from controller.objects import Kind


def _api() -> tuple[SimpleNamespace, SimpleNamespace, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def lister(**kwargs: Any) -> SimpleNamespace:
        calls.append(kwargs)
        return SimpleNamespace(data=json.dumps({"items": [], "metadata": {}}).encode())

    core = SimpleNamespace(list_pod_for_all_namespaces=lister, list_node=lister)
    resource = SimpleNamespace(
        list_resource_claim_for_all_namespaces=lister,
        list_resource_slice=lister,
        list_device_class=lister,
    )
    return core, resource, calls


def test_resource_slices_are_listed_in_small_pages() -> None:
    """A page of slices is held whole while it is parsed; other kinds keep the usual page."""
    core, resource, calls = _api()
    informers = standard_informers(
        core, resource, lambda *_: None, lambda _: None, InformerConfig(page_size=500)
    )
    by_kind = {i.kind: i for i in informers}
    by_kind[Kind.SLICE]._list()
    by_kind[Kind.POD]._list()
    assert [c["limit"] for c in calls] == [SLICE_PAGE_SIZE, 500]
    small = standard_informers(
        core, resource, lambda *_: None, lambda _: None, InformerConfig(page_size=20)
    )
    next(i for i in small if i.kind is Kind.SLICE)._list()
    assert calls[-1]["limit"] == 20
