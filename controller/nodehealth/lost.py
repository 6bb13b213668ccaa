"""What the controller does with the claims of a lost node (`signals` says when one is lost).

A lost node gets no new placements (the planner's node fit refuses it). Its claims are freed
as far as is safe, and the users are told what and why, once:

1. The node finalizer (the node prepared the claim) is removed on a strong signal only
   (deleted, out-of-service), once no pod that may still run there uses the claim.
2. Then the allocation is cleared as soon as nothing reserves the claim (kube-controller-
   manager drops deleted pods from `reservedFor`), which frees the placement in the model;
   pods not yet bound are placed again elsewhere, so the controller's finalizer stays while
   such a pod waits.

docs/controller.md, "Lost nodes", tells the whole story.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence

from controller.config import ReconcilerConfig
from controller.nodehealth.signals import NodeLoss, node_loss, not_ready_deadline
from controller.objects import Kind, has_finalizer, is_allocated, key_of, node_finalizers
from controller.seams import ClaimWriter, Recorder
from controller.store import ClusterStore
from driver.apiviews import ClaimView, PodView
from process.kube import Obj

_log = logging.getLogger(__name__)


class LostNodes:
    """The node verdicts of the last pass, and what was done about their claims."""

    def __init__(
        self,
        *,
        store: ClusterStore,
        writer: ClaimWriter,
        recorder: Recorder,
        config: ReconcilerConfig,
        written: Callable[[Obj], None],
        wall_clock: Callable[[], dt.datetime],
    ) -> None:
        """`written(claim)` stores a claim this controller just wrote."""
        self._store = store
        self._writer = writer
        self._recorder = recorder
        self._cfg = config
        self._written = written
        self._wall = wall_clock
        # The last verdict per node that claims are allocated to, and when to look again (a
        # NotReady node's grace ends).
        self._lost: dict[str, NodeLoss] = {}
        self._nodes_changed = True
        self._next_check: dt.datetime | None = None
        # Claims this controller cleared because of a loss: their pods are placed again, not
        # told that kube-scheduler rejected the placement.
        self._cleared: dict[str, NodeLoss] = {}
        self._told: dict[str, str] = {}  # claim key -> the last loss message told (once)

    # -- what changed ----------------------------------------------------------------------

    def node_changed(self) -> None:
        self._nodes_changed = True

    def claim_gone(self, claim_key: str) -> None:
        self._told.pop(claim_key, None)

    def reallocated(self, claim_key: str) -> None:
        """The claim is allocated again: whatever a loss cleared is history."""
        self._cleared.pop(claim_key, None)

    def cleared_by_loss(self, claims: Sequence[Obj]) -> list[NodeLoss]:
        """The losses that cleared these claims' allocations, forgotten once asked."""
        losses = [self._cleared.pop(key_of(c), None) for c in claims]
        return [loss for loss in losses if loss is not None]

    # -- verdicts --------------------------------------------------------------------------

    def _loss_of_node(self, node: str, now: dt.datetime) -> NodeLoss | None:
        return node_loss(
            node, self._store.objects[Kind.NODE].get(node), now, self._cfg.node_loss_grace
        )

    def loss_of(self, claim: Obj, now: dt.datetime) -> NodeLoss | None:
        """The loss of the node the claim is allocated to, if that node is lost."""
        node = ClaimView(claim).node
        return None if node is None else self._loss_of_node(node, now)

    def on_lost_node(self, claims: Sequence[Obj]) -> bool:
        now = self._wall()
        return any(self.loss_of(c, now) is not None for c in claims)

    def node_pass(self) -> list[str]:
        """Notice nodes that became lost (a Node event, or a NotReady node's grace ran out);
        returns the keys of the claims allocated there, for the release pass."""
        now = self._wall()
        due = self._next_check is not None and now >= self._next_check
        if not (self._nodes_changed or due):
            return []
        self._nodes_changed = False
        self._next_check = None
        by_node: dict[str, list[str]] = {}
        for key, claim in self._store.claims.items():
            node = ClaimView(claim).node
            if node is not None:
                by_node.setdefault(node, []).append(key)
        lost: dict[str, NodeLoss] = {}
        newly: list[str] = []
        for node, keys in sorted(by_node.items()):
            loss = self._loss_of_node(node, now)
            if loss is None:
                self._look_again_at_grace_end(node)
                continue
            lost[node] = loss
            before = self._lost.get(node)
            if before is None or before.signal is not loss.signal:
                _log.warning(
                    "%s; %d claim(s) allocated there",
                    loss.describe(),
                    len(keys),
                    extra={"node": node},
                )
                newly.extend(keys)
        for node in sorted(self._lost.keys() - lost.keys()):
            _log.info("node %s is no longer lost", node, extra={"node": node})
        self._lost = lost
        return newly

    def _look_again_at_grace_end(self, node: str) -> None:
        obj = self._store.objects[Kind.NODE].get(node)
        deadline = not_ready_deadline(obj, self._cfg.node_loss_grace) if obj else None
        if deadline is not None:
            deadline += dt.timedelta(seconds=1)
            if self._next_check is None or deadline < self._next_check:
                self._next_check = deadline

    # -- freeing a lost node's claims ------------------------------------------------------

    def release(self, claim: Obj, loss: NodeLoss) -> None:
        """A claim allocated to a lost node: free what can be freed safely (the module
        docstring's two steps), say what and why."""
        key = key_of(claim)
        pods = self._store.pods
        users = [pods[p] for p in sorted(self._store.users_of(key)) if p in pods]
        blocking = [key_of(p) for p in users if _blocks_release(p, loss)]
        movable = [key_of(p) for p in users if _movable(PodView(p))]
        node_fin = self._cfg.contract.node_finalizer(loss.node)
        prepared = has_finalizer(claim, node_fin)
        if blocking:
            if prepared:
                self._tell(
                    claim,
                    f"{loss.describe()}; the claim keeps its placement while pod "
                    f"{', '.join(blocking)} may still run there",
                )
            return
        if prepared:
            freed = self._drop_node_finalizer(claim, loss, node_fin)
            if freed is None:
                return
            claim = freed
        if not has_finalizer(claim, self._cfg.finalizer) or node_finalizers(
            claim, self._cfg.contract
        ):
            return  # not ours to clear, or another node's instance is still there
        if ClaimView(claim).reserved_for:
            return  # kube-controller-manager drops deleted pods; the claim event brings us back
        self._clear(claim, loss, movable)
        self._told.pop(key, None)

    def _drop_node_finalizer(self, claim: Obj, loss: NodeLoss, node_fin: str) -> Obj | None:
        """Remove a prepared claim's node finalizer on a strong signal (the instance counts as
        destroyed); on NotReady alone say why the claim keeps its placement (None)."""
        if not loss.strong:
            self._tell(
                claim,
                f"{loss.describe()}; no new placements go there, but its MIG instance may "
                "still exist, so the claim keeps its placement until the node is Ready "
                "again, is deleted, or is tainted node.kubernetes.io/out-of-service",
            )
            return None
        key = key_of(claim)
        claim = self._writer.remove_node_finalizer(claim, node_fin)
        self._written(claim)
        self._recorder.event(
            claim,
            Kind.CLAIM,
            "Warning",
            "NodeLost",
            f"{loss.describe()}: its MIG instance counts as destroyed; "
            f"removed the node finalizer {node_fin}",
        )
        _log.warning(
            "claim %s: removed node finalizer %s (%s)",
            key,
            node_fin,
            loss.detail,
            extra={"claim": key, "node": loss.node},
        )
        return claim

    def _clear(self, claim: Obj, loss: NodeLoss, movable: Sequence[str]) -> None:
        """Clear the allocation (its placement is free) and, unless a pod waits to be placed
        again elsewhere, drop the controller's finalizer."""
        key = key_of(claim)
        deleting = ClaimView(claim).deleting
        if is_allocated(claim):
            claim = self._writer.clear_allocation(claim)
            self._written(claim)
            self._cleared[key] = loss
            then = (
                f"; pod {', '.join(movable)} will be placed on another node"
                if movable and not deleting
                else ""
            )
            self._recorder.event(
                claim,
                Kind.CLAIM,
                "Warning",
                "NodeLost",
                f"{loss.describe()}: allocation cleared, its placement is free{then}",
            )
            _log.info(
                "claim %s: allocation on lost node %s cleared",
                key,
                loss.node,
                extra={"claim": key, "node": loss.node},
            )
        if deleting or not movable:
            self._written(self._writer.remove_finalizer(claim))
            self._cleared.pop(key, None)

    def _tell(self, claim: Obj, message: str) -> None:
        key = key_of(claim)
        if self._told.get(key) == message:
            return
        self._told[key] = message
        self._recorder.event(claim, Kind.CLAIM, "Warning", "NodeLost", message)


def _movable(pod: PodView) -> bool:
    """A user that can be placed again elsewhere: not bound yet, and not being deleted."""
    return not pod.node_name and not pod.deleting


def _blocks_release(pod: Obj, loss: NodeLoss) -> bool:
    """Whether a live pod that uses a claim on a lost node may still be using its instance.

    Pods not yet bound never ran there. A pod bound to the lost node stops counting on a strong
    signal (the node is gone or out of service, its workloads stopped, exactly what Kubernetes
    assumes for non-graceful node shutdown), even while it still shows as Running or
    Terminating; on NotReady alone it keeps counting, terminating or not.
    """
    bound = PodView(pod).node_name
    if not bound:
        return False
    return not (loss.strong and bound == loss.node)
