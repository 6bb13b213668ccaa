"""The node side of ``python -m bench.cluster_packing``: no kubelet or plugin runs, so
:class:`NodeStandIn` plays their part in a claim's life as the plugin does it, with the
plugin's own claim client (``kubeletplugin.claims.KubernetesClaimClient``):

- when a pod is bound, it adds the node's finalizer to the pod's claims (the plugin does so
  when it carves, at prepare);
- when the pod is gone, it waits ``destroy_s`` (the simulator's GI destroy) and removes it (the
  plugin does so once the MIG instance is destroyed).

carve's controller frees a placement only after that (DESIGN invariant 4), and on the native
path the claim, and with it its devices, stays until then.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from driver.contract import DEFAULT_CONTRACT
from tests.bench.alibaba import DRIVER


class NodeStandIn:
    """The plugin's finalizer handshake for every pod of one namespace (module docstring).

    Each pod's steps run in order on one worker (chosen by the pod's name), so a pod's
    unprepare never overtakes its prepare."""

    def __init__(self, api: Any, namespace: str, destroy_s: float, workers: int = 4) -> None:
        from kubeletplugin.claims import KubernetesClaimClient

        self._claims = KubernetesClaimClient(api)
        self._ns = namespace
        self._destroy_s = destroy_s
        self._queues: list[queue.Queue[Callable[[], None] | None]] = [
            queue.Queue() for _ in range(workers)
        ]
        self._prepared: dict[str, list[tuple[str, str, str]]] = {}  # pod -> (claim, uid, fin)
        self._lock = threading.Lock()
        self._timers: list[tuple[float, int, str]] = []
        self._timer_wake = threading.Condition(self._lock)
        self._serial = 0
        self._stop = threading.Event()
        self.devices: dict[str, tuple[Any, ...]] = {}  # pod -> devices its claims got
        # Pods whose every claim carried carve's allocation finalizer when the node saw it.
        self.carve_allocated: set[str] = set()
        self.finalizers_added = 0
        self.finalizers_removed = 0
        # Claims already gone or going when the node got to them: with a kubelet, the pod would
        # have been deleted before it started. Their devices may be missing from the records.
        self.late = 0
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._work, args=(q,), daemon=True) for q in self._queues
        ]
        self._threads.append(threading.Thread(target=self._timer_loop, daemon=True))
        for t in self._threads:
            t.start()

    def _queue_for(self, pod: str) -> queue.Queue[Callable[[], None] | None]:
        return self._queues[hash(pod) % len(self._queues)]

    def bound(self, pod: str, node: str, claims: Sequence[str]) -> None:
        self._queue_for(pod).put(lambda: self._prepare(pod, node, claims))

    def gone(self, pod: str) -> None:
        with self._timer_wake:
            self._serial += 1
            heapq.heappush(self._timers, (time.monotonic() + self._destroy_s, self._serial, pod))
            self._timer_wake.notify()

    def _prepare(self, pod: str, node: str, claims: Sequence[str]) -> None:
        from kubeletplugin.claims import ClaimGoneError

        if not claims:
            self.errors.append(f"prepare {pod}: the bound pod names no claim in its status")
        finalizer = DEFAULT_CONTRACT.node_finalizer(node)
        done: list[tuple[str, str, str]] = []
        devices: list[Any] = []
        by_carve = bool(claims)
        for name in claims:
            try:
                view = self._claims.get(self._ns, name)
                if view is None:  # the pod came and went before the node got to it
                    with self._lock:
                        self.late += 1
                    continue
                devices.extend(view.results_for(DRIVER))
                by_carve &= DEFAULT_CONTRACT.allocation_finalizer in view.finalizers
                self._claims.add_finalizer(self._ns, name, view.uid, finalizer)
                done.append((name, view.uid, finalizer))
                with self._lock:
                    self.finalizers_added += 1
            except ClaimGoneError:
                with self._lock:
                    self.late += 1
                continue
            except Exception as exc:  # recorded, never fatal: the figures say how many
                self.errors.append(f"prepare {pod}/{name}: {exc}")
        with self._lock:
            self._prepared[pod] = done
            self.devices[pod] = tuple(devices)
            if by_carve:
                self.carve_allocated.add(pod)

    def _unprepare(self, pod: str) -> None:
        with self._lock:
            done = self._prepared.pop(pod, [])
        for name, uid, finalizer in done:
            try:
                self._claims.remove_finalizer(self._ns, name, uid, finalizer)
                with self._lock:
                    self.finalizers_removed += 1
            except Exception as exc:
                self.errors.append(f"unprepare {pod}/{name}: {exc}")

    def _timer_loop(self) -> None:
        while not self._stop.is_set():
            with self._timer_wake:
                while not self._stop.is_set() and (
                    not self._timers or self._timers[0][0] > time.monotonic()
                ):
                    wait = self._timers[0][0] - time.monotonic() if self._timers else 1.0
                    self._timer_wake.wait(max(0.01, min(1.0, wait)))
                if self._stop.is_set():
                    return
                _, _, pod = heapq.heappop(self._timers)
            self._queue_for(pod).put(lambda p=pod: self._unprepare(p))  # type: ignore[misc]

    def _work(self, q: queue.Queue[Callable[[], None] | None]) -> None:
        while True:
            step = q.get()
            if step is None:
                return
            step()

    def pending(self) -> int:
        with self._lock:
            return len(self._timers) + sum(q.qsize() for q in self._queues)

    def stop(self) -> None:
        self._stop.set()
        with self._timer_wake:
            self._timer_wake.notify_all()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=10)
