"""A list-then-watch loop over every ResourceClaim, for carving before bind.

The node agent otherwise reads a claim only when the kubelet names it. To carve while the pod
is still being scheduled it must see the allocation as it is written, and claims cannot be
selected by node on the server, so it watches them all and drops what is not its own at once
(`kubeletplugin.precarve`). Raw JSON, as everywhere in the agent: the generated models drop the
binding-condition fields of older client releases.

A relist (410 Gone, or any watch failure) delivers every claim again as "ADDED"; the consumer is
idempotent, so a missed event is repaired by the next list rather than tracked here.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], None]

_PATH = "/apis/resource.k8s.io/v1/resourceclaims"


class ClaimApi(Protocol):
    """What the watch needs of `process.kube.jsonclient.KubeJson`."""

    def request(
        self, method: str, path: str, *, query: Sequence[tuple[str, str]] = ()
    ) -> dict[str, Any]: ...

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]] = (), timeout: float
    ) -> Iterator[str]: ...


class _ExpiredError(Exception):
    """The watch's resourceVersion is too old: list again."""


class ClaimWatch:
    """Calls `handler(event type, claim)` for every claim, from one thread, until `stop()`."""

    def __init__(
        self,
        api: ClaimApi,
        handler: Handler,
        *,
        page_size: int = 500,
        watch_timeout_s: int = 300,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._api = api
        self._handler = handler
        self._page = page_size
        self._timeout = watch_timeout_s
        self._backoff_max = backoff_max_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()
        self.last_error = ""  # why the last list or watch failed; "" once one worked again

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="claim-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A watch blocked in a read ends within its timeout; the thread is a daemon.
            self._thread.join(timeout=2)

    def _run(self) -> None:
        failures = 0
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                    self.synced.set()
                self.last_error = ""
                rv = self._watch(rv)
                failures = 0
            except _ExpiredError:
                rv = None
            except Exception as e:
                failures += 1
                rv = None
                self.last_error = f"cannot list/watch ResourceClaims: {e}"
                delay = min(self._backoff_max, 0.2 * 2**failures) * random.uniform(0.5, 1)
                log.warning(
                    "claim list/watch failed; retrying",
                    extra={"error": str(e), "retryIn": round(delay, 1)},
                )
                self._stop.wait(delay)

    def _list(self) -> str:
        token = ""
        while True:
            query = [("limit", str(self._page))]
            if token:
                query.append(("continue", token))
            page = self._api.request("GET", _PATH, query=query)
            for item in page.get("items") or []:
                self._deliver("ADDED", item)
            meta = page.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return str(meta.get("resourceVersion", ""))

    def _watch(self, rv: str) -> str:
        query = [
            ("watch", "true"),
            ("resourceVersion", rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(self._timeout)),
        ]
        for line in self._api.stream(_PATH, query=query, timeout=self._timeout + 30):
            if self._stop.is_set():
                break
            if not line.strip():
                continue
            event = json.loads(line)
            obj = event.get("object") or {}
            kind = str(event.get("type", ""))
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise _ExpiredError()
                raise RuntimeError(f"claim watch error: {obj.get('message')}")
            rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
            if kind != "BOOKMARK":
                self._deliver(kind, obj)
        return rv

    def _deliver(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            self._handler(kind, obj)
        except Exception:
            # One claim the consumer cannot handle must not stop the watch for the others.
            log.exception("handling a claim event failed", extra={"event": kind})
