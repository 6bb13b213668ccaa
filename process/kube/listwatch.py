"""List then watch one collection, the one loop both programs keep their view of the API with.

The loop (`ListWatch.run`) lists the collection page by page, then watches from the list's
resourceVersion with bookmarks on, so a reconnect resumes where it left off rather than
listing again. It lists again only when it must:

- the resourceVersion is too old (410 Gone: on the watch request, or as a watch ERROR event);
- a continue token expired half-way through a list (the list starts over, for one consistent
  snapshot);
- an opted-in periodic resync (`resync_period_s`, off by default: at 1,000 GPU nodes one
  relist moves a few hundred MB of ResourceSlices).

Any other failure (a reset stream, a refused request) is retried with jittered exponential
backoff, resuming the watch from the last resourceVersion the loop returned to, and says why
in `last_error` until a list or watch works again. An optional resource that the server does
not serve (404) counts as listed and empty (`Sink.not_served`) and is looked for again every
`absent_recheck_s`.

What the objects become is the `Sink`'s: the controller's informers diff a relist against
their cache (`controller.informers`), the node agent's claim watch hands every claim on
(`kubeletplugin.claimwatch`). Where they come from is the `Collection`'s: a path of the JSON
client (`JsonCollection`), or a test's script.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from process.kube import Obj
from process.kube.errors import GoneError, status_of
from process.kube.jsonclient import JsonApi, LineStream

_log = logging.getLogger(__name__)


class Collection(Protocol):
    """Where one collection's list pages and watch streams come from."""

    def page(self, limit: int, token: str) -> Obj:
        """One page of the list (`token`: the previous page's continue token, or "")."""

    def watch(self, resource_version: str, timeout_s: int) -> LineStream:
        """A watch from `resource_version` with bookmarks, ended by the server after
        `timeout_s`: its newline-delimited JSON events."""


class Sink(Protocol):
    """What becomes of what the loop sees."""

    def listing(self) -> None:
        """A list starts (again): drop what an unfinished one gathered."""

    def listed(self, obj: Obj) -> None:
        """One object of the list."""

    def list_complete(self) -> None:
        """The list is complete: every object in it has been given to `listed`."""

    def changed(self, type_: str, obj: Obj) -> None:
        """A watch event: ADDED, MODIFIED or DELETED."""

    def not_served(self) -> None:
        """An optional resource the server does not serve: there is none of it."""


@dataclass(frozen=True)
class ListWatchConfig:
    page_size: int = 500
    watch_timeout_s: int = 300
    resync_period_s: float | None = None  # None: never relist while the watch holds
    backoff_max_s: float = 30.0
    absent_recheck_s: float = 300.0  # an optional resource the server does not serve


class JsonCollection:
    """A collection at an API path, through the JSON client; `query` narrows it (a field
    selector)."""

    def __init__(self, api: JsonApi, path: str, query: Sequence[tuple[str, str]] = ()) -> None:
        self._api = api
        self._path = path
        self._query = tuple(query)

    def page(self, limit: int, token: str) -> Obj:
        query = [*self._query, ("limit", str(limit)), *([("continue", token)] if token else [])]
        return self._api.request("GET", self._path, query=query)

    def watch(self, resource_version: str, timeout_s: int) -> LineStream:
        query = [
            *self._query,
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_s)),
        ]
        return self._api.stream(self._path, query=query, timeout=timeout_s + 30)


class ListWatch:
    """Keeps `sink` told of `collection` until `stop()`; `name` is for logs and errors."""

    def __init__(
        self,
        collection: Collection,
        sink: Sink,
        *,
        name: str,
        config: ListWatchConfig | None = None,
        optional: bool = False,
    ) -> None:
        self.name = name
        self._collection = collection
        self._sink = sink
        self._cfg = config or ListWatchConfig()
        self._optional = optional
        self._stop = threading.Event()
        self._stream: LineStream | None = None
        self.relists = 0
        self.last_error = ""  # why the last list or watch failed; "" once one worked again

    # -- list ----------------------------------------------------------------------------------

    def list(self) -> str:
        """The whole collection, page by page, into the sink; returns the list's
        resourceVersion to watch from."""
        token = ""
        self._sink.listing()
        while True:
            try:
                page = self._collection.page(self._cfg.page_size, token)
            except Exception as exc:
                if status_of(exc) == 410 and token:
                    # The continue token expired mid-list: start over for a consistent snapshot.
                    token = ""
                    self._sink.listing()
                    continue
                raise
            for obj in page.get("items") or []:
                self._sink.listed(obj)
            meta = page.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                self._sink.list_complete()
                self.relists += 1
                return str(meta.get("resourceVersion", ""))
            del page  # the next page is held alone

    # -- watch ---------------------------------------------------------------------------------

    def watch(self, rv: str, until: float, clock: Callable[[], float]) -> str:
        """Watch from `rv` until `until` or `stop()`, reconnecting each time the server ends
        the stream; returns the last resourceVersion seen."""
        while not self._stop.is_set() and clock() < until:
            timeout = max(1, int(min(self._cfg.watch_timeout_s, until - clock())))
            stream = self._collection.watch(rv, timeout)
            self._stream = stream
            try:
                for line in stream:
                    if self._stop.is_set():
                        break
                    if line.strip():
                        rv = self.on_event(json.loads(line), rv)
            finally:
                self._stream = None
                _close(stream)
        return rv

    def on_event(self, event: Obj, rv: str) -> str:
        """Hand one watch event to the sink; returns the resourceVersion to resume from."""
        type_ = str(event.get("type", ""))
        obj = event.get("object") or {}
        if type_ == "ERROR":
            if obj.get("code") == 410:
                raise GoneError(410, str(obj.get("message", "too old resource version")))
            raise RuntimeError(f"watch error for {self.name}: {obj.get('message')}")
        new_rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
        if type_ != "BOOKMARK":
            self._sink.changed(type_, obj)
        return new_rv

    # -- loop ----------------------------------------------------------------------------------

    def run(self, clock: Callable[[], float] = time.monotonic) -> None:
        """List, watch, list again when it must, until `stop()` (see the module docstring)."""
        failures = 0
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self.list()
                self.last_error = ""
                period = self._cfg.resync_period_s
                next_resync = math.inf if period is None else clock() + period
                rv = self.watch(rv, next_resync, clock)
                if clock() >= next_resync:
                    rv = None  # an opted-in periodic full relist
                failures = 0
            except Exception as exc:
                if self._stop.is_set():
                    break
                if status_of(exc) == 410:
                    _log.info("%s watch expired; relisting", self.name)
                    rv = None
                    continue
                if self._optional and status_of(exc) == 404:
                    self._sink.not_served()
                    self.last_error = ""
                    rv = None
                    self._stop.wait(self._cfg.absent_recheck_s)
                    continue
                failures += 1
                self.last_error = f"cannot list/watch {self.name}: {exc}"
                delay = min(self._cfg.backoff_max_s, 0.2 * 2**failures) * random.uniform(0.5, 1)
                _log.warning("%s list/watch failed (%s); retrying in %.1fs", self.name, exc, delay)
                self._stop.wait(delay)

    def stop(self) -> None:
        """End the loop; a watch blocked in a read is closed so its thread ends now."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            _close(stream)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


def _close(stream: LineStream) -> None:
    try:
        stream.close()
    except Exception:  # closing a stream another thread is reading may refuse; it ends anyway
        _log.debug("closing a watch stream failed", exc_info=True)
