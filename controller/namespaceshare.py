"""How many waiting pods of one namespace the controller keeps in memory (issue 41.5).

Without a bound, one namespace with no quota that creates some 60,000 pods with carve claims ran
the controller past its memory limit, and it crash-looped for every namespace. So each
namespace's *waiting* pods (those that may still need the controller: `controller.work.
may_need_work`) are kept up to a share (`--namespace-pod-share`); past it a pod is *shed*: the
pod informer does not keep it (its transform returns None), nor the claims made for it from a
template while it is shed. What a shed pod costs is its key.

A shed pod is not lost. When one of its namespace's kept pods stops waiting (placed, ended,
deleted), the oldest shed pod of that namespace is given the room: it is read again
(`Refetcher`, one GET) and delivered as the watch would have (`Informer.refresh`), and so are
its claims. Within a namespace past its share, pods are therefore taken in the order they came;
a pod's priority counts once it is kept. Allocated claims and claims being deleted are never
shed: they hold devices, or wait for carve's finalizer to go.

The informers' threads call in (`admit`, `release`, `sheds_claim`), the refetch thread and
the decision thread read (`take_reads`, `take_newly_shed`), hence the lock. Shedding is told:
a Warning event on shed pods (at most `EVENT_BURST` per namespace at once, then one every
`EVENT_EVERY_S`, so a flood of 50,000 is not also a flood of 50,000 Events), the gauge
`carve_shed_pods` and the counter `carve_pods_shed_total`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from controller.objects import Kind, is_allocated
from driver.apiviews import ObjectView
from process.kube import Obj
from process.kube.errors import status_of

_log = logging.getLogger(__name__)

DEFAULT_SHARE = 5000
EVENT_BURST = 20
EVENT_EVERY_S = 10.0
SHED_REASON = "NamespaceOverShare"


@dataclass(frozen=True)
class ShedPod:
    """What the event on a shed pod names (the pod itself is not kept)."""

    namespace: str
    name: str
    uid: str
    resource_version: str

    def as_object(self) -> Obj:
        return {
            "kind": "Pod",
            "metadata": {
                "namespace": self.namespace,
                "name": self.name,
                "uid": self.uid,
                "resourceVersion": self.resource_version,
            },
        }


def _namespace(key: str) -> str:
    return key.partition("/")[0]


class NamespaceShare:
    """Which waiting pods of each namespace are kept, which are shed, and which to read again."""

    def __init__(self, limit: int | None = DEFAULT_SHARE) -> None:
        """`limit`: waiting pods kept per namespace (None or 0: no bound)."""
        self.limit = limit or None
        self._lock = threading.Lock()
        self._kept: dict[str, set[str]] = {}  # namespace -> keys of its kept waiting pods
        self._shed: dict[str, dict[str, None]] = {}  # namespace -> shed keys, oldest first
        self._pods_to_read: set[str] = set()  # given room, not delivered again yet
        self._claims_of: dict[str, set[str]] = {}  # shed pod key -> keys of its shed claims
        self._claims_to_read: set[str] = set()
        self._newly_shed: list[ShedPod] = []
        self.shed_total = 0

    # -- the pod informer's transform ----------------------------------------------------------

    def admit(self, pod: Obj) -> bool:
        """A waiting pod was delivered: True to keep it, False to shed it."""
        view = ObjectView(pod)
        key = f"{view.namespace}/{view.name}"
        with self._lock:
            kept = self._kept.setdefault(view.namespace, set())
            if key in kept:
                self._pods_to_read.discard(key)
                return True
            if self.limit is None or len(kept) < self.limit:
                kept.add(key)
                self._claims_to_read.update(self._claims_of.pop(key, ()))
                self._shed.get(view.namespace, {}).pop(key, None)
                return True
            shed = self._shed.setdefault(view.namespace, {})
            if key not in shed:
                shed[key] = None
                self.shed_total += 1
                self._newly_shed.append(
                    ShedPod(view.namespace, view.name, view.uid, view.resource_version)
                )
            return False

    def release(self, key: str) -> None:
        """The pod stopped waiting (bound, ended, being deleted) or is gone: its room goes to
        the namespace's oldest shed pod."""
        ns = _namespace(key)
        with self._lock:
            self._pods_to_read.discard(key)
            shed = self._shed.get(ns)
            if shed is not None and shed.pop(key, "absent") is None:
                self._claims_of.pop(key, None)
            kept = self._kept.get(ns)
            if kept is None or key not in kept:
                return
            kept.discard(key)
            while shed and (self.limit is None or len(kept) < self.limit):
                oldest = next(iter(shed))
                del shed[oldest]
                kept.add(oldest)
                self._pods_to_read.add(oldest)
                self._claims_to_read.update(self._claims_of.pop(oldest, ()))
            if not kept and not shed:
                self._kept.pop(ns, None)
                self._shed.pop(ns, None)

    # -- the claim informer's transform --------------------------------------------------------

    def sheds_claim(self, claim: Obj) -> bool:
        """Whether this carve claim is shed: unallocated, not being deleted, and made for a
        shed pod (its controlling owner, as a template's claim names its pod)."""
        view = ObjectView(claim)
        key = f"{view.namespace}/{view.name}"
        owner = next(
            (r for r in view.owner_references if r.get("kind") == "Pod" and r.get("controller")),
            None,
        )
        pod_key = f"{view.namespace}/{owner.get('name')}" if owner is not None else None
        with self._lock:
            shed = (
                pod_key is not None
                and not view.deleting
                and not is_allocated(claim)
                and pod_key in self._shed.get(view.namespace, {})
            )
            if shed and pod_key is not None:
                self._claims_of.setdefault(pod_key, set()).add(key)
            else:
                self._claims_to_read.discard(key)  # kept: delivered, whether read or watched
            return shed

    def claim_gone(self, key: str) -> None:
        with self._lock:
            self._claims_to_read.discard(key)

    # -- readers -------------------------------------------------------------------------------

    def wants(self, kind: Kind, key: str) -> bool:
        """Whether an object read again is still wanted (not delivered or deleted since)."""
        with self._lock:
            return key in (self._pods_to_read if kind is Kind.POD else self._claims_to_read)

    def take_reads(self) -> list[tuple[Kind, str]]:
        """The pods given room and their claims, to read again (each handed out once)."""
        with self._lock:
            out = [(Kind.POD, k) for k in sorted(self._pods_to_read)]
            out += [(Kind.CLAIM, k) for k in sorted(self._claims_to_read)]
            return out

    def take_newly_shed(self) -> list[ShedPod]:
        with self._lock:
            out, self._newly_shed = self._newly_shed, []
            return out

    def shed_now(self) -> dict[str, int]:
        """Shed pods by namespace, now."""
        with self._lock:
            return {ns: len(keys) for ns, keys in self._shed.items() if keys}


class Refetcher:
    """Reads the pods (and claims) given room again and delivers them to their informer; one
    read each, retried after a second while the object is still wanted."""

    def __init__(
        self,
        share: NamespaceShare,
        read: Callable[[Kind, str], Obj],
        deliver: Callable[[Kind, Obj], bool],
        *,
        period_s: float = 0.2,
    ) -> None:
        """`read(kind, key)`: the object now (raises on failure, 404 for gone); `deliver(kind,
        obj)`: hand it to the informer unless that delivered it, or its deletion, meanwhile."""
        self._share = share
        self._read = read
        self._deliver = deliver
        self._period = period_s
        self._stop = threading.Event()
        self._failed: dict[tuple[Kind, str], float] = {}

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self._period):
            self.read_once(time.monotonic())

    def read_once(self, now: float) -> int:
        """Read what is due; returns how many were delivered."""
        delivered = 0
        for kind, key in self._share.take_reads():
            if self._failed.get((kind, key), 0.0) > now:
                continue
            try:
                obj = self._read(kind, key)
            except Exception as exc:
                if status_of(exc) == 404:
                    self._gone(kind, key)
                else:
                    _log.info("reading %s %s again failed: %s", kind, key, exc)
                    self._failed[(kind, key)] = now + 1.0
                continue
            self._failed.pop((kind, key), None)
            if self._share.wants(kind, key) and self._deliver(kind, obj):
                delivered += 1
        return delivered

    def _gone(self, kind: Kind, key: str) -> None:
        self._failed.pop((kind, key), None)
        if kind is Kind.POD:
            self._share.release(key)
        else:
            self._share.claim_gone(key)


class ShedReport:
    """Tells what the share shed: events on shed pods (bounded per namespace) and the gauges,
    from the decision thread."""

    def __init__(
        self,
        share: NamespaceShare,
        event: Callable[[Obj, Kind, str, str, str], None],
        set_gauge: Callable[[int], None],
        count: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._share = share
        self._event = event
        self._set_gauge = set_gauge
        self._count = count
        self._clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}  # namespace -> (tokens, at)

    def report(self) -> None:
        shed = self._share.take_newly_shed()
        now_shed = self._share.shed_now()
        self._set_gauge(sum(now_shed.values()))
        if not shed:
            return
        self._count(len(shed))
        now = self._clock()
        for pod in shed:
            if not self._take_token(pod.namespace, now):
                continue
            waiting = now_shed.get(pod.namespace, 0)
            self._event(
                pod.as_object(),
                Kind.POD,
                "Warning",
                SHED_REASON,
                f"namespace {pod.namespace} has {self._share.limit} pods waiting for carve "
                f"already, its share (--namespace-pod-share); this pod waits outside it, with "
                f"{waiting} others, and is taken up in the order it came once earlier pods of "
                "the namespace are placed or deleted. Spread the work over namespaces, admit it "
                "through a queue (Kueue), or ask the operator to raise the share",
            )

    def _take_token(self, ns: str, now: float) -> bool:
        tokens, at = self._tokens.get(ns, (float(EVENT_BURST), now))
        tokens = min(float(EVENT_BURST), tokens + (now - at) / EVENT_EVERY_S)
        if tokens < 1.0:
            self._tokens[ns] = (tokens, now)
            return False
        self._tokens[ns] = (tokens - 1.0, now)
        return True
