"""A list-then-watch loop over every ResourceClaim, for carving before bind.

The node agent otherwise reads a claim only when the kubelet names it. To carve while the pod
is still being scheduled it must see the allocation as it is written, and claims cannot be
selected by node on the server, so it watches them all and drops what is not its own at once
(`kubeletplugin.precarve`). Raw JSON, as everywhere in the agent: the generated models drop the
binding-condition fields of older client releases.

The loop is `process.kube.listwatch`, the controller's informers' too: a reconnect resumes
from the last resourceVersion, a 410 Gone lists again. A list delivers every claim as "ADDED";
the consumer is idempotent, so a missed event is repaired by the next list rather than
tracked here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from process.kube import Obj
from process.kube.jsonclient import JsonApi
from process.kube.listwatch import JsonCollection, ListWatch, ListWatchConfig

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], None]

_PATH = "/apis/resource.k8s.io/v1/resourceclaims"


class ClaimWatch:
    """Calls `handler(event type, claim)` for every claim, from one thread, until `stop()`."""

    def __init__(
        self,
        api: JsonApi,
        handler: Handler,
        *,
        page_size: int = 500,
        watch_timeout_s: int = 300,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._handler = handler
        self._loop = ListWatch(
            JsonCollection(api, _PATH),
            self,
            name="ResourceClaims",
            config=ListWatchConfig(
                page_size=page_size, watch_timeout_s=watch_timeout_s, backoff_max_s=backoff_max_s
            ),
        )
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()

    @property
    def last_error(self) -> str:
        """Why the last list or watch failed; "" once one worked again."""
        return self._loop.last_error

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop.run, name="claim-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._loop.stop()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # -- process.kube.listwatch.Sink -----------------------------------------------------------

    def listing(self) -> None:
        """Nothing to drop: what a list delivered stays delivered."""

    def listed(self, obj: Obj) -> None:
        self._deliver("ADDED", obj)

    def list_complete(self) -> None:
        self.synced.set()

    def changed(self, type_: str, obj: Obj) -> None:
        self._deliver(type_, obj)

    def not_served(self) -> None:
        """ResourceClaims are always served (resource.k8s.io/v1 is required)."""

    def _deliver(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            self._handler(kind, obj)
        except Exception:
            # One claim the consumer cannot handle must not stop the watch for the others.
            log.exception("handling a claim event failed", extra={"event": kind})
