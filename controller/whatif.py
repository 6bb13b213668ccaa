"""What the engine would decide if some allocated claims were freed: `EnginePlanner`'s
what-ifs, on the same engine and the same model as a real decision, the model left as it was.

Two readers: the preemption search (`placement_without`, its oracle: a victim set is judged by
whether its slices really combine) and carve's autoscaler hint (`fits_after_release`, whether
a refused pod waits for a release in flight rather than for a new node, `controller.autoscaling`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

from controller.claims import ClaimKey
from controller.model import ClusterModel
from controller.objects import Unplaceable
from controller.placement import Placement, PlacementEngine, PlacementRequest
from process.kube import Obj


class WhatIf:
    """Mixed into `EnginePlanner`, which provides the model, the engine, the claims' model
    keys and `placement_request`."""

    model: ClusterModel
    engine: PlacementEngine
    _claim_keys: dict[str, ClaimKey]

    def placement_request(self, pod: Obj, claims: Sequence[Obj]) -> PlacementRequest | Unplaceable:
        raise NotImplementedError  # EnginePlanner's

    def placement_without(
        self, request: PlacementRequest, node: str, claims: Iterable[str], pods: Iterable[str]
    ) -> Placement | None:
        """The engine's placement for ``request`` on ``node`` if the given allocated claims
        (store keys) were released and the given pods gone; the model is left as it was.

        This is the preemption search's oracle: the same engine, on the same model, as a real
        decision, so a victim set is judged by whether its slices really combine.
        """
        holds = [
            h
            for k in claims
            if (ck := self._claim_keys.get(k)) is not None
            and (h := self.model.hold_of(ck)) is not None
        ]
        usage = [(p, u) for p in pods if (u := self.model.pod_usage(p)) is not None]
        for h in holds:
            self.model.release(h.claim)
        for p, _ in usage:
            self.model.remove_pod(p)
        try:
            result = self.engine.place(replace(request, node=node))
        finally:
            for h in holds:
                self.model.hold(h)
            for p, (n, r) in usage:
                self.model.set_pod(p, n, r)
        return result if isinstance(result, Placement) else None

    def fits_after_release(
        self, pod: Obj, claims: Sequence[Obj], released: Collection[str]
    ) -> bool:
        """`Planner.fits_after_release`: `placement_without` on each node where the claims
        `released` (store keys) hold slices."""
        holds = [self.model.hold_of(ck) for k in released if (ck := self._claim_keys.get(k))]
        nodes = sorted({h.node for h in holds if h is not None and h.node})
        request = self.placement_request(pod, claims) if nodes else None
        if request is None or isinstance(request, Unplaceable):
            return False
        nodes = [n for n in nodes if request.node in (None, n)]  # a pinned pod: its node only
        return any(self.placement_without(request, n, released, ()) is not None for n in nodes)
