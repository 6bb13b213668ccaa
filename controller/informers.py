"""List-then-watch caches of raw API objects, one thread per resource.

Objects are kept as the apiserver's JSON (dicts with camelCase keys) rather than the client's
generated model classes: the models silently drop fields they do not know, and the DRA API grows
fields every release (a 1.37 server may send what a 37.x client lacks). The list-and-watch loop
is `process.kube.listwatch`, the node agent's claim watch's too; an informer is its sink.

Contract with the consumer (`Reconciler.enqueue` / `mark_synced`):
- after the first complete list, every object has been delivered as ADDED and `on_synced` is
  called once; a restarted controller therefore decides only on a full picture;
- a relist (410 Gone, expired continue token, any watch failure we cannot resume from) is
  diffed against the cache: changed objects come as MODIFIED, vanished ones as DELETED, so
  missed events are repaired rather than replayed blindly;
- a `transform` decides what is kept of each object (`controller.cache`); when it returns None
  the object is not cached, and one that was cached is delivered as DELETED, so the consumer
  sees exactly the objects the cache holds;
- with `skip_unchanged`, an update whose transformed object differs from the cached one only
  in resourceVersion refreshes the cache silently (a node's heartbeat, once trimmed, changes
  nothing the controller reads).

Watches, not polling: after the first list an informer only watches (bookmarks keep its
resourceVersion fresh, so a reconnect resumes instead of relisting). A periodic full relist is
off by default (`resync_period_s=None`); at 1,000 GPU nodes one relist moves a few hundred MB of
ResourceSlices. The reconciler's own periodic re-examination works from the cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from controller.namespaceshare import NamespaceShare
from controller.objects import CarveClasses, EventType, Kind, key_of
from driver.apiviews import ObjectView
from driver.contract import DEFAULT_CONTRACT, Contract
from process.kube import Obj
from process.kube.errors import status_of
from process.kube.jsonclient import JsonApi, LineStream
from process.kube.listwatch import Collection, JsonCollection, ListWatch, ListWatchConfig

Handler = Callable[[Kind, EventType, Obj], None]
T = TypeVar("T")

_log = logging.getLogger(__name__)

InformerConfig = ListWatchConfig
"""Page size, watch timeout, resync period, backoff and the recheck of an absent resource."""


SLICE_PAGE_SIZE = 100
"""List page size for ResourceSlices. A GPU's devices slice is ~28 KB of JSON, several times that
as parsed dicts until it is packed (`controller.cache`): a page of 500 held ~50 MB at once, and
the process kept that as resident memory after the list (~20 MB more at 300 GPU nodes)."""


class Informer:
    """Keeps `cache` equal to the server's collection and reports every change to `handler`.

    The list-and-watch loop is `process.kube.listwatch.ListWatch`; this is its sink: it keeps
    what `transform` keeps of each object and diffs a relist against the cache."""

    def __init__(
        self,
        kind: Kind,
        source: Collection,
        handler: Handler,
        on_synced: Callable[[Kind], None],
        config: InformerConfig | None = None,
        *,
        transform: Callable[[Obj], Obj | None] | None = None,
        skip_unchanged: bool = False,
        optional: bool = False,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        """`source`: the collection (`process.kube.listwatch.JsonCollection`: a path of the JSON
        client). `optional`: a resource an older server may not serve (404): then it holds
        nothing, counts as listed, and is looked for again every `absent_recheck_s`.
        `on_removed(key)`: an object was deleted or vanished from a relist, whether kept or
        not (what the transform remembers of it can go)."""
        self.kind = kind
        self._transform = transform
        self._on_removed = on_removed
        # Held while one change is applied and delivered, so that an object read again
        # (`refresh`) and the watch's own events reach the handler in the order applied.
        self._delivery = threading.Lock()
        self._skip_unchanged = skip_unchanged
        self._handler = handler
        self._on_synced = on_synced
        self._lock = threading.Lock()
        self.cache: dict[str, Obj] = {}
        self._fresh: dict[str, Obj] = {}
        self._synced = False
        self.skipped = 0
        self._loop = ListWatch(source, self, name=str(kind), config=config, optional=optional)

    @property
    def has_synced(self) -> bool:
        return self._synced

    @property
    def relists(self) -> int:
        return self._loop.relists

    def run(self, clock: Callable[[], float]) -> None:
        """List, watch, relist on expiry and every resync period, until `stop()`."""
        self._loop.run(clock)

    def stop(self) -> None:
        self._loop.stop()

    def _list(self) -> str:
        return self._loop.list()

    def _not_served(self) -> None:
        self.not_served()

    # -- process.kube.listwatch.Sink -----------------------------------------------------------

    def listing(self) -> None:
        self._fresh = {}

    def listed(self, obj: Obj) -> None:
        """Each object is transformed as it arrives: holding the raw collection until the end
        made the list's peak (and so the process's resident size, which Python rarely gives
        back) the size of everything the cache then throws away."""
        obj.setdefault("kind", str(self.kind))
        item = obj if self._transform is None else self._transform(obj)
        if item is not None:
            self._fresh[key_of(item)] = item

    def list_complete(self) -> None:
        fresh, self._fresh = self._fresh, {}
        self._replace(fresh)

    def not_served(self) -> None:
        """The server does not serve this optional resource (yet): it has none of it."""
        if not self._synced or self.cache:
            _log.info("%s is not served; none is applied until it is", self.kind)
        self._replace({})

    def _replace(self, fresh: dict[str, Obj]) -> None:
        with self._delivery:
            self._replace_delivered(fresh)

    def _replace_delivered(self, fresh: dict[str, Obj]) -> None:
        with self._lock:
            old, self.cache = self.cache, dict(fresh)
        for key, obj in old.items():
            if key not in fresh:
                if self._on_removed is not None:
                    self._on_removed(key)
                self._handler(self.kind, EventType.DELETED, obj)
        for key, obj in fresh.items():
            prev = old.get(key)
            if prev is None:
                self._handler(self.kind, EventType.ADDED, obj)
            elif _rv(prev) != _rv(obj) and not (
                self._skip_unchanged and _same_apart_from_version(prev, obj)
            ):
                self._handler(self.kind, EventType.MODIFIED, obj)
        if not self._synced:
            self._synced = True
            self._on_synced(self.kind)

    def changed(self, type_: str, obj: Obj) -> None:
        with self._delivery:
            self._changed(type_, obj)

    def refresh(self, obj: Obj, wanted: Callable[[str], bool]) -> bool:
        """An object read again outside the watch (`controller.namespaceshare`), applied as a
        watch's MODIFIED would be, unless the watch delivered it meanwhile (it is cached) or
        `wanted(key)` says it is no longer wanted (deleted meanwhile). True if applied."""
        with self._delivery:
            key = key_of(obj)
            with self._lock:
                cached = key in self.cache
            if cached or not wanted(key):
                return False
            self._changed("MODIFIED", obj)
            return True

    def _changed(self, type_: str, obj: Obj) -> None:
        obj.setdefault("kind", str(self.kind))
        key = key_of(obj)
        kept = obj if self._transform is None else self._transform(obj)
        with self._lock:
            prev = self.cache.get(key)
            if type_ == "DELETED" or kept is None:
                self.cache.pop(key, None)
            else:
                self.cache[key] = kept
        if type_ == "DELETED" and self._on_removed is not None:
            self._on_removed(key)
        if kept is None or type_ == "DELETED":
            if prev is not None:
                self._handler(self.kind, EventType.DELETED, kept or prev)
            return
        if prev is None:
            self._handler(self.kind, EventType.ADDED, kept)
        elif self._skip_unchanged and _same_apart_from_version(prev, kept):
            self.skipped += 1
        else:
            self._handler(self.kind, EventType.MODIFIED, kept)


def _rv(obj: Obj) -> str:
    return ObjectView(obj).resource_version


def _same_apart_from_version(a: Obj, b: Obj) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if k != "metadata":
            if v != b[k]:
                return False
            continue
        other = b[k]
        if not isinstance(v, dict) or not isinstance(other, dict) or v.keys() != other.keys():
            return False
        if any(v[m] != other[m] for m in v if m != "resourceVersion"):
            return False
    return True


def start_informers(
    informers: list[Informer], clock: Callable[[], float]
) -> list[threading.Thread]:
    threads = []
    for inf in informers:
        t = threading.Thread(
            target=inf.run, args=(clock,), name=f"informer-{inf.kind}", daemon=True
        )
        t.start()
        threads.append(t)
    return threads


_PATHS = {
    Kind.POD: "/api/v1/pods",
    Kind.NODE: "/api/v1/nodes",
    Kind.CLAIM: "/apis/resource.k8s.io/v1/resourceclaims",
    Kind.SLICE: "/apis/resource.k8s.io/v1/resourceslices",
    Kind.CLASS: "/apis/resource.k8s.io/v1/deviceclasses",
}
TAINT_RULE_PATHS = (
    "/apis/resource.k8s.io/v1/devicetaintrules",
    "/apis/resource.k8s.io/v1beta2/devicetaintrules",
)
"""Where DeviceTaintRules are served: resource.k8s.io/v1 from Kubernetes 1.37, v1beta2 on 1.36
only where enabled; the first served is used."""


def standard_informers(
    api: JsonApi,
    handler: Handler,
    on_synced: Callable[[Kind], None],
    config: InformerConfig | None = None,
    *,
    contract: Contract = DEFAULT_CONTRACT,
    classes: CarveClasses | None = None,
    share: NamespaceShare | None = None,
) -> list[Informer]:
    """The collections the controller watches, all cluster-wide, through the JSON client (so
    the request counter and the error hierarchy see them), each kept only as far as the
    controller reads it (`controller.cache`): ResourceSlices of carve's driver only (a field
    selector, so the apiserver sends no other driver's), claims of carve's classes or holding
    carve's devices. Nodes skip updates that change nothing kept (heartbeats).
    DeviceTaintRules are optional (`TAINT_RULE_PATHS`). With a `share`, waiting pods past
    their namespace's share are not kept, nor their claims (`controller.namespaceshare`)."""
    from controller.cache import claim_view, pod_view, slice_view, strip_bookkeeping, trim_node

    config = config or InformerConfig()
    classes = classes or CarveClasses.of(contract)
    configs = {k: config for k in Kind}
    configs[Kind.SLICE] = replace(config, page_size=min(config.page_size, SLICE_PAGE_SIZE))
    collections: dict[Kind, Collection] = {
        kind: JsonCollection(api, path) for kind, path in _PATHS.items()
    }
    collections[Kind.SLICE] = JsonCollection(
        api, _PATHS[Kind.SLICE], [("fieldSelector", f"spec.driver={contract.driver}")]
    )
    collections[Kind.TAINT_RULE] = FirstServed(*(JsonCollection(api, p) for p in TAINT_RULE_PATHS))
    transforms: dict[Kind, Callable[[Obj], Obj | None]] = {
        Kind.POD: pod_view(contract.scheduling_gate, contract.driver, share),
        Kind.NODE: trim_node,
        Kind.SLICE: slice_view(),
        Kind.CLAIM: claim_view(classes, contract.driver, share),
        Kind.CLASS: strip_bookkeeping,
        Kind.TAINT_RULE: strip_bookkeeping,
    }
    removed: dict[Kind, Callable[[str], None]] = (
        {Kind.POD: share.release, Kind.CLAIM: share.claim_gone} if share is not None else {}
    )
    return [
        Informer(
            k,
            collection,
            handler,
            on_synced,
            configs[k],
            transform=transforms[k],
            skip_unchanged=k is Kind.NODE,
            optional=k is Kind.TAINT_RULE,
            on_removed=removed.get(k),
        )
        for k, collection in collections.items()
    ]


class FirstServed:
    """A collection served at the first of several API versions the server serves (the others
    answer 404), remembered until that one answers 404 too (the version was switched off, or
    the cluster upgraded). With none served the 404 is raised."""

    def __init__(self, *collections: Collection) -> None:
        self._collections = collections
        self._chosen: Collection | None = None

    def _first(self, ask: Callable[[Collection], T]) -> T:
        missing: Exception = _NotServedError()
        chosen = self._chosen
        order = [*([chosen] if chosen else []), *(c for c in self._collections if c is not chosen)]
        for candidate in order:
            try:
                result = ask(candidate)
            except Exception as exc:
                if status_of(exc) != 404:
                    raise
                self._chosen = None
                missing = exc
                continue
            self._chosen = candidate
            return result
        raise missing

    def page(self, limit: int, token: str) -> Obj:
        return self._first(lambda c: c.page(limit, token))

    def watch(self, resource_version: str, timeout_s: int) -> LineStream:
        return self._first(lambda c: c.watch(resource_version, timeout_s))


class _NotServedError(Exception):
    """No API version to ask was given: the resource counts as not served."""

    status = 404
