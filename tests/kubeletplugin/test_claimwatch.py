"""The plugin's claim watch: pages of the list, then watch events; a 410 or a broken stream
lists again; a handler that raises does not stop the watch. (Against the real apiserver it
runs in tests/e2e/test_binding_conditions.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kubeletplugin.claimwatch import ClaimWatch
from process.kube.errors import api_error


def _claim(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name, "uid": name, "resourceVersion": rv}}


class _Api:
    """Serves scripted lists and watch streams, in order; records what was asked."""

    def __init__(self, lists: list[list[dict[str, Any]]], streams: list[list[Any]]) -> None:
        self.lists = lists
        self.streams = streams
        self.queries: list[tuple[str, Sequence[tuple[str, str]]]] = []
        self.done = threading.Event()

    def request(
        self, method: str, path: str, *, query: Sequence[tuple[str, str]] = ()
    ) -> dict[str, Any]:
        self.queries.append(("list", query))
        if not self.lists:
            self.done.set()
            raise api_error(403, 'resourceclaims is forbidden: cannot "list"')
        return self.lists.pop(0)[0]

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]] = (), timeout: float
    ) -> Iterator[str]:
        self.queries.append(("watch", query))
        if not self.streams:
            self.done.set()
            threading.Event().wait(0.05)
            return
        for event in self.streams.pop(0):
            if isinstance(event, Exception):
                raise event
            yield json.dumps(event)


def _page(items: list[dict[str, Any]], rv: str, token: str = "") -> list[dict[str, Any]]:
    meta: dict[str, str] = {"resourceVersion": rv}
    if token:
        meta["continue"] = token
    return [{"items": items, "metadata": meta}]


def test_lists_every_page_watches_and_relists_after_410() -> None:
    api = _Api(
        lists=[
            _page([_claim("a", "1")], "5", token="t1"),
            _page([_claim("b", "2")], "5"),
            _page([_claim("a", "9")], "9"),
        ],
        streams=[
            [
                {"type": "MODIFIED", "object": _claim("a", "6")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
                {"type": "DELETED", "object": _claim("b", "8")},
                {"type": "ERROR", "object": {"code": 410, "message": "too old"}},
            ]
        ],
    )
    seen: list[tuple[str, str, str]] = []

    def handler(kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        seen.append((kind, meta["name"], meta["resourceVersion"]))
        if meta["name"] == "b" and kind == "ADDED":
            raise RuntimeError("a bad claim")  # must not stop the watch

    watch = ClaimWatch(api, handler, backoff_max_s=0.01)
    watch.start()
    assert api.done.wait(5)
    watch.stop()
    assert seen[:5] == [
        ("ADDED", "a", "1"),
        ("ADDED", "b", "2"),
        ("MODIFIED", "a", "6"),
        ("DELETED", "b", "8"),
        ("ADDED", "a", "9"),  # the relist after 410
    ]
    assert watch.synced.is_set()
    lists = [q for kind, q in api.queries if kind == "list"]
    assert ("continue", "t1") in lists[1]
    first_watch = next(q for kind, q in api.queries if kind == "watch")
    assert ("resourceVersion", "5") in first_watch and (
        "allowWatchBookmarks",
        "true",
    ) in first_watch


def test_a_broken_stream_resumes_the_watch_without_listing_again() -> None:
    """A reset stream is no reason to move every claim in the cluster again: the watch
    resumes from the last resourceVersion (a 410 would then say a list is needed)."""
    api = _Api(
        lists=[_page([_claim("a", "1")], "3")],
        streams=[
            [ConnectionError("reset by peer")],
            [{"type": "MODIFIED", "object": _claim("a", "4")}],
        ],
    )
    seen: list[str] = []
    watch = ClaimWatch(
        api, lambda k, o: seen.append(o["metadata"]["resourceVersion"]), backoff_max_s=0.01
    )
    watch.start()
    assert api.done.wait(5)
    watch.stop()
    assert seen[:2] == ["1", "4"]
    watches = [q for kind, q in api.queries if kind == "watch"]
    assert [kind for kind, _ in api.queries[:3]] == ["list", "watch", "watch"]
    assert ("resourceVersion", "3") in watches[1]


def test_a_watch_that_cannot_list_says_why() -> None:
    """What /readyz shows (check `claimwatch`) when the plugin lacks the permission."""
    api = _Api(lists=[], streams=[])
    watch = ClaimWatch(api, lambda k, o: None, backoff_max_s=0.01)
    watch.start()
    assert api.done.wait(5)
    watch.stop()
    assert not watch.synced.is_set()
    assert watch.last_error.startswith("cannot list/watch ResourceClaims: ")
    assert "forbidden" in watch.last_error
