"""Placing the pending queue jointly, with room kept for pods that have waited too long.

:meth:`PlacementEngine.place` decides for one pod; a queue served one pod at a time in its
order (kube-scheduler's way, and the reconciler's today) gives freed room to whichever waiting
pod comes first, even when a different choice among the waiting pods would place more. When
several pods wait, :class:`QueuePlacer` tries several orders of the first ``window`` pods, each
as a sequence of real engine decisions on the model, and keeps the order that places the most
weight (the caller's measure of a pod's size, e.g. its GPU share). The queue order itself is
always tried first and wins ties, so a joint plan never places less weight of the window than
serving the window in queue order would, and every placement of a plan was decided on a model
that already held the plan's earlier placements, so no device is given twice. The search is
bounded by a number of orders and a wall-clock budget.

Serving what fits now, in queue order or jointly, can leave a large pod waiting for ever while
smaller pods keep taking the room it needs as it frees (a pod of 8 whole GPUs needs a whole
node at once; a one-GPU pod behind it needs any GPU). A pod of at least ``keep_min_weight``
that has waited ``keep_after`` seconds or longer gets a node kept for it (the ``max_kept``
longest-waiting ones do): no other pod of the queue is placed there until it is placed
(anywhere). The kept node is one whose GPUs and allocatable resources would take the pod once
empty, the one with the most free GPU memory among those, chosen again on every pass. Keeping a
whole node is coarse for a one-slice pod, and exact for the multi-GPU pods that starve in
practice.

Like the engine, the placer leaves the model as it found it: it records each tentative
placement (:meth:`PlacementEngine.commit`) and takes it back before it answers, and it hides
kept nodes from other pods by presenting them cordoned to the engine for the duration of a
decision. The caller writes the plan's placements in the order given (a simulation commits
them). It keeps one piece of state across calls, the nodes kept for starving pods.

It lives with the benchmarks, not in ``controller.placement``: the reconciler places one pod at
a time (``controller/placing.py``) and never calls it; the queued replay (``queued.py``) does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from controller.model import ClusterModel
from controller.nodefit import NodeInfo
from controller.placement.engine import PlacementEngine
from controller.placement.values import NoPlacement, Placement, PlacementRequest


@dataclass(frozen=True)
class Waiting:
    """A pod in the pending queue: its request, when it started waiting (on the caller's
    clock, the one ``now`` is given on) and what placing it is worth (its GPU share, say)."""

    request: PlacementRequest
    since: float
    weight: float = 1.0


@dataclass(frozen=True)
class QueuePlan:
    """Placements to write, in this order (each was decided with the earlier ones in place)."""

    placements: tuple[tuple[str, Placement], ...]
    kept: Mapping[str, str]
    """Starving pod -> the node kept for it, after this plan."""
    orders_tried: int
    queue_order_weight: float
    """Weight the window would get served in queue order; ``weight`` is at least this."""
    weight: float


@dataclass(frozen=True)
class _Trial:
    placements: tuple[tuple[int, Placement], ...]  # (index in the window, placement), in order
    weight: float


class QueuePlacer:
    """Joint placement of the pending queue; see the module docstring."""

    def __init__(
        self,
        engine: PlacementEngine,
        *,
        window: int = 12,
        max_orders: int = 24,
        budget_s: float = 0.05,
        keep_after: float | None = None,
        keep_min_weight: float = 0.0,
        max_kept: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window < 1 or max_orders < 1 or max_kept < 0:
            raise ValueError("window and max_orders must be >= 1, max_kept >= 0")
        self.engine = engine
        self.window = window
        self.max_orders = max_orders
        self.budget_s = budget_s
        self.keep_after = keep_after
        self.keep_min_weight = keep_min_weight
        self.max_kept = max_kept
        self._clock = clock
        self.decisions = 0
        """Engine decisions made so far (tentative ones included)."""
        self._kept: dict[str, str] = {}  # pod -> node
        self._fits_empty: dict[tuple[object, ...], bool] = {}

    @property
    def model(self) -> ClusterModel:
        return self.engine.model

    @property
    def kept(self) -> Mapping[str, str]:
        return dict(self._kept)

    # ------------------------------------------------------------------------------------------
    # Entry points

    def place_one(self, waiting: Waiting) -> Placement | NoPlacement:
        """One pod's decision, outside the nodes kept for other pods (a new arrival while
        nothing was freed: it is the only pod whose answer can have changed)."""
        self.decisions += 1
        with self._hiding_kept_from(waiting.request.pod):
            return self.engine.place(waiting.request)

    def plan(self, waiting: Sequence[Waiting], now: float) -> QueuePlan:
        """The placements for the queue (in its order of service): the best order found for
        the first ``window`` pods that could be placed now, then the other such pods in queue
        order. A pod the engine cannot place alone on the model as it is cannot be placed
        after others either (they only take room), so the window skips those."""
        self._update_kept(waiting, now)
        placeable = self._placeable(waiting)
        window, tail = placeable[: self.window], placeable[self.window :]
        started = self._clock()
        first = self._trial(window, range(len(window)))
        best, tried = first, 1
        for order in self._orders(window, first):
            if best.weight >= sum(w.weight for w in window) - 1e-12:
                break  # everything in the window placed: no order can do better
            if tried >= self.max_orders or self._clock() - started > self.budget_s:
                break
            trial = self._trial(window, order)
            tried += 1
            if trial.weight > best.weight + 1e-12:
                best = trial
        placements: list[tuple[str, Placement]] = []
        with self._tentative() as record:
            for i, placement in best.placements:
                pod = window[i]
                record(pod, placement)
                placements.append((pod.request.pod, placement))
            failed: set[tuple[object, ...]] = set()
            for pod in tail:
                shape = self._shape(pod)
                if shape in failed:
                    continue
                result = self.place_one(pod)
                if isinstance(result, Placement):
                    record(pod, result)
                    placements.append((pod.request.pod, result))
                else:
                    failed.add(shape)
        for pod_name, _ in placements:
            self._kept.pop(pod_name, None)
        return QueuePlan(tuple(placements), dict(self._kept), tried, first.weight, best.weight)

    def _placeable(self, waiting: Sequence[Waiting]) -> list[Waiting]:
        """The pods the engine would place alone now, one decision per distinct shape."""
        verdicts: dict[tuple[object, ...], bool] = {}
        out = []
        for w in waiting:
            shape = self._shape(w)
            ok = verdicts.get(shape)
            if ok is None:
                ok = verdicts[shape] = isinstance(self.place_one(w), Placement)
            if ok:
                out.append(w)
        return out

    def _shape(self, pod: Waiting) -> tuple[object, ...]:
        """What a decision depends on besides the model: pods of one shape get one answer
        (the owner of a kept node sees that node, so it is a shape of its own)."""
        request = pod.request
        return (
            request.needs,
            request.node,
            tuple(c.spec for c in request.claims),
            request.pod if request.pod in self._kept else None,
        )

    # ------------------------------------------------------------------------------------------
    # Orders

    def _orders(self, window: Sequence[Waiting], first: _Trial) -> Iterator[Sequence[int]]:
        """Orders to try after the queue order: heaviest first, then each pod that the queue
        order left out moved to the front (with and without heaviest-first behind it). Pods of
        one shape are interchangeable, so only the first left-out pod of a shape that the queue
        order placed none of is moved."""
        queue = list(range(len(window)))
        heavy = sorted(queue, key=lambda i: -window[i].weight)
        seen = {tuple(queue)}

        def fresh(order: list[int]) -> bool:
            key = tuple(order)
            if key in seen:
                return False
            seen.add(key)
            return True

        if fresh(heavy):
            yield heavy
        placed = {i for i, _ in first.placements}
        shapes = {self._shape(window[i]) for i in placed}
        movers = []
        for i in queue:
            shape = self._shape(window[i])
            if i not in placed and shape not in shapes:
                shapes.add(shape)
                movers.append(i)
        for i in movers:
            order = [i] + [j for j in queue if j != i]
            if fresh(order):
                yield order
        for i in movers:
            order = [i] + [j for j in heavy if j != i]
            if fresh(order):
                yield order

    def _trial(self, window: Sequence[Waiting], order: Sequence[int] | range) -> _Trial:
        """Serve the window in ``order`` on the model, then take it all back. Once a shape
        is refused, later pods of that shape are too (the model only fills up meanwhile)."""
        placements: list[tuple[int, Placement]] = []
        weight = 0.0
        failed: set[tuple[object, ...]] = set()
        with self._tentative() as record:
            for i in order:
                shape = self._shape(window[i])
                if shape in failed:
                    continue
                result = self.place_one(window[i])
                if isinstance(result, Placement):
                    record(window[i], result)
                    placements.append((i, result))
                    weight += window[i].weight
                else:
                    failed.add(shape)
        return _Trial(tuple(placements), weight)

    @contextmanager
    def _tentative(self) -> Iterator[Callable[[Waiting, Placement], None]]:
        """Placements recorded in the model while the block runs, taken back after it."""
        done: list[tuple[Waiting, Placement]] = []

        def record(pod: Waiting, placement: Placement) -> None:
            self.engine.commit(placement, pod.request.pod, pod.request.needs)
            done.append((pod, placement))

        try:
            yield record
        finally:
            for pod, placement in reversed(done):
                for hold in placement.holds():
                    self.model.release(hold.claim)
                self.model.remove_pod(pod.request.pod)

    # ------------------------------------------------------------------------------------------
    # Starvation guard

    @contextmanager
    def _hiding_kept_from(self, pod: str) -> Iterator[None]:
        """Nodes kept for other pods look cordoned to the engine during the block."""
        hidden: list[NodeInfo] = []
        for owner, node in self._kept.items():
            info = self.model.nodes.get(node)
            if owner != pod and info is not None and not info.unschedulable:
                hidden.append(info)
                self.model.set_node(dataclasses.replace(info, unschedulable=True))
        try:
            yield
        finally:
            for info in hidden:
                self.model.set_node(info)

    def _update_kept(self, waiting: Sequence[Waiting], now: float) -> None:
        """Keep nodes for the longest-waiting large pods past ``keep_after``. The kept node
        is chosen again on every pass (staying put on ties): only departures free room on
        it, and if another node has drained further meanwhile (the first may run a pod that
        lives for days), the pod is better off waiting for that one."""
        present = {w.request.pod for w in waiting}
        old = {pod: node for pod, node in self._kept.items() if pod in present}
        self._kept = {}
        if self.keep_after is None:
            return
        starving = sorted(
            (
                w
                for w in waiting
                if now - w.since >= self.keep_after and w.weight >= self.keep_min_weight
            ),
            key=lambda w: (w.since, w.request.pod),
        )
        for w in starving:
            if len(self._kept) >= self.max_kept:
                break
            node = self._node_to_keep(w, old.get(w.request.pod))
            if node is not None:
                self._kept[w.request.pod] = node

    def _node_to_keep(self, pod: Waiting, current: str | None) -> str | None:
        """The node with the most free GPU memory among those that would take the pod empty
        and are not kept for another pod; ``current`` wins ties."""
        taken = set(self._kept.values())
        best: tuple[float, bool, str] | None = None
        for node in sorted(self.model.gpu_nodes()):
            if node in taken or node not in self.model.nodes:
                continue
            if not self._fits_when_empty(pod, node):
                continue
            gpus = self.model.gpus_on(node)
            free = sum(
                0
                if g.occupancy.blocked
                else g.inventory.model.memory_units - g.occupancy.state.occupied.bit_count()
                for g in gpus
            ) / max(1, sum(g.inventory.model.memory_units for g in gpus))
            key = (free, node == current, node)
            if best is None or key[:2] > best[:2]:
                best = key
        return best[2] if best is not None else None

    def _fits_when_empty(self, pod: Waiting, node: str) -> bool:
        """Whether the engine would place the pod on the node with nothing else on it: a
        one-node model with the node's published GPUs, no holds and no pods."""
        info = self.model.nodes[node]
        inventories = tuple(g.inventory for g in self.model.gpus_on(node))
        request = dataclasses.replace(pod.request, node=None)
        key = (
            info,
            tuple(inv.model.key for inv in inventories),
            request.needs,
            tuple(c.spec for c in request.claims),
        )
        hit = self._fits_empty.get(key)
        if hit is None:
            scratch = ClusterModel()
            scratch.set_node(info)
            scratch.set_node_gpus(node, inventories)
            engine = PlacementEngine(
                scratch,
                self.engine.classes,
                self.engine.driver,
                policy=self.engine.policy,
                evaluator=self.engine.evaluator,
            )
            hit = isinstance(engine.place(request), Placement)
            if len(self._fits_empty) > 10_000:
                self._fits_empty.clear()
            self._fits_empty[key] = hit
        return hit
