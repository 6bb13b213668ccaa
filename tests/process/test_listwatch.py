"""The one list-and-watch loop (`process.kube.listwatch`) against a scripted collection: the
parts neither of its users' tests reach (tests/controller/test_informers*.py and
tests/kubeletplugin/test_claimwatch.py hold the rest)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from process.kube.errors import api_error
from process.kube.listwatch import ListWatch, ListWatchConfig


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def listing(self) -> None:
        self.calls.append(("listing", None))

    def listed(self, obj: dict[str, Any]) -> None:
        self.calls.append(("listed", obj["metadata"]["name"]))

    def list_complete(self) -> None:
        self.calls.append(("complete", None))

    def changed(self, type_: str, obj: dict[str, Any]) -> None:
        self.calls.append((type_, obj["metadata"]["name"]))

    def not_served(self) -> None:
        self.calls.append(("not served", None))


def _obj(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": "1"}}


class _Pages:
    """Pages in order; an exception in the script is raised instead of a page."""

    def __init__(self, *pages: Any) -> None:
        self.pages = list(pages)
        self.tokens: list[str] = []

    def page(self, limit: int, token: str) -> dict[str, Any]:
        self.tokens.append(token)
        item = self.pages.pop(0)
        if isinstance(item, Exception):
            raise item
        return dict(item)

    def watch(self, resource_version: str, timeout_s: int) -> Any:
        raise AssertionError("not watched in this test")


def test_an_expired_continue_token_starts_the_list_over() -> None:
    pages = _Pages(
        {"items": [_obj("a")], "metadata": {"continue": "t1"}},
        api_error(410, "the provided continue parameter is too old"),
        {"items": [_obj("a"), _obj("b")], "metadata": {"resourceVersion": "9"}},
    )
    sink = _Sink()
    assert ListWatch(pages, sink, name="things").list() == "9"
    assert pages.tokens == ["", "t1", ""]
    assert sink.calls == [
        ("listing", None),
        ("listed", "a"),
        ("listing", None),  # the sink drops the unfinished list's "a"
        ("listed", "a"),
        ("listed", "b"),
        ("complete", None),
    ]


def test_an_optional_resource_not_served_counts_as_listed_and_empty() -> None:
    sink = _Sink()
    loop = ListWatch(
        _Pages(api_error(404, "the server could not find the requested resource")),
        sink,
        name="rules",
        config=ListWatchConfig(absent_recheck_s=30),
        optional=True,
    )
    original = sink.not_served

    def not_served() -> None:
        original()
        loop.stop()  # one round is enough

    sink.not_served = not_served  # type: ignore[method-assign]
    loop.run()
    assert sink.calls == [("listing", None), ("not served", None)]
    assert loop.last_error == ""


class _BlockingStream:
    """A watch that yields nothing until it is closed, as a quiet apiserver's would."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[str]:
        self.opened.set()
        self.closed.wait(30)
        return iter(())

    def close(self) -> None:
        self.closed.set()


def test_stop_closes_the_watch_in_flight() -> None:
    """A stopping process must not wait out a five-minute watch."""
    stream = _BlockingStream()

    class _Quiet(_Pages):
        def watch(self, resource_version: str, timeout_s: int) -> Any:
            return stream

    loop = ListWatch(
        _Quiet({"items": [], "metadata": {"resourceVersion": "1"}}), _Sink(), name="things"
    )
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert stream.opened.wait(5)
    loop.stop()
    thread.join(5)
    assert not thread.is_alive() and stream.closed.is_set()
