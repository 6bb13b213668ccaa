"""Preemption as the reconciler runs it: candidates from the stores, the search, evictions.

Called when a pod is unplaceable (``Reconciler(preemption=...)``, from `controller.placing`).
It gathers the pods of lower priority that hold carve slices, asks ``controller.preemption.
search`` for the cheapest set whose removal lets the pod fit (the oracle is the placement engine
on the planner's model), sends the evictions of that set as a dry run, then for real, tells both
sides in events, and has the planner hold the freed slices for the preemptor until it is placed.

A PodDisruptionBudget is honoured twice: budgets whose status the disruption controller has
observed limit how many of their pods a set may take (``disruptionsAllowed``); any other refusal
is the Eviction API's own 429 on the dry run, after which that pod is left out and the search
runs again.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller.objects import Kind, Unplaceable, key_of, pod_claim_names
from controller.planner import EnginePlanner
from controller.preemption.eviction import (
    EvictionFencedError,
    EvictionOutcome,
    Evictor,
    describe_failure,
)
from controller.preemption.search import (
    Candidate,
    SearchLimits,
    VictimSet,
    cheapest_victims,
    label_selector_matches,
    may_preempt,
)
from controller.seams import Recorder
from driver.apiviews import ObjectView, PodView
from process.kube import Obj

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreemptionConfig:
    hold_s: float = 300.0
    """How long freed slices are held for a preemptor that has not been placed yet."""
    limits: SearchLimits = field(default_factory=SearchLimits)
    searches: int = 4
    """Searches per decision: each dry-run refusal (a PDB) leaves a pod out and searches again."""


def _parse_time(value: object) -> dt.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class Preemptor:
    """See the module docstring. Runs on the reconciler's thread only."""

    def __init__(
        self,
        planner: EnginePlanner,
        evictor: Evictor,
        recorder: Recorder,
        *,
        config: PreemptionConfig | None = None,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._planner = planner
        self._evictor = evictor
        self._recorder = recorder
        self._cfg = config or PreemptionConfig()
        self._wall = wall_clock
        self._index_cache: tuple[tuple[int, int], list[tuple[str, str, list[str]]]] | None = None

    def unplaceable(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        why: Unplaceable,
        stores: Mapping[Kind, Mapping[str, Obj]],
    ) -> Unplaceable:
        """What to tell about a pod that fits nowhere, after evicting for it if that helps."""
        key = key_of(pod)
        if why.permanent or self._planner.reservation(key) is not None:
            return why
        prio = PodView(pod).priority
        candidates, claims_of = self._candidates(key, prio, stores)
        if not candidates:
            return why
        if not may_preempt(PodView(pod).spec):
            return Unplaceable(
                why.reason,
                f"{why.message}; its preemptionPolicy is Never, so carve evicts no "
                "lower-priority pod for it",
            )
        request = self._planner.placement_request(pod, claims)
        if isinstance(request, Unplaceable):
            return why
        if request.node is not None:  # some claims are allocated there, or the pod is bound
            candidates = [c for c in candidates if c.node == request.node]

        def feasible(node: str, victims: frozenset[str]) -> bool:
            freed = [c for v in victims for c in claims_of[v]]
            return self._planner.placement_without(request, node, freed, victims) is not None

        allowances, budgets_of = self._budgets(candidates, stores)
        pool = [
            Candidate(c.pod, c.node, c.priority, c.running_s, budgets_of.get(c.pod, ()))
            for c in candidates
        ]
        refused: list[str] = []
        for _ in range(self._cfg.searches):
            result = cheapest_victims(
                prio, pool, feasible, allowances=allowances, limits=self._cfg.limits
            )
            chosen = result.chosen
            if chosen is None:
                break
            blocked = self._dry_run(chosen, stores)
            if blocked:
                refused.extend(f"{p} ({m})" for p, m in blocked.items())
                pool = [c for c in pool if c.pod not in blocked]
                continue
            return self._evict(
                pod,
                chosen,
                request=request,
                claims_of=claims_of,
                stores=stores,
                checks=result.checks,
            )
        if not refused and allowances:
            # Was it the budgets? A set that frees a placement when they are left out says so.
            free = cheapest_victims(prio, pool, feasible, allowances={}, limits=self._cfg.limits)
            if free.chosen is not None:
                names = sorted({b for v in free.chosen.victims for b in v.budgets})
                spent = [f"{b} (allows {allowances.get(b, 0)} more)" for b in names]
                return Unplaceable(
                    "PreemptionBlocked",
                    f"{why.message}; evicting lower-priority pods would free a placement, but "
                    f"their PodDisruptionBudgets forbid it: {', '.join(spent)}; waiting",
                )
        if refused:
            return Unplaceable(
                "PreemptionBlocked",
                f"{why.message}; evicting lower-priority pods would free a placement, but the "
                f"Eviction API refused {'; '.join(refused)}, and no other set of "
                "lower-priority pods frees one; waiting",
            )
        return Unplaceable(
            why.reason,
            f"{why.message}; evicting lower-priority pods would not free a placement either",
        )

    # -- candidates ----------------------------------------------------------------------------

    def _candidates(
        self, preemptor: str, prio: int, stores: Mapping[Kind, Mapping[str, Obj]]
    ) -> tuple[list[Candidate], dict[str, list[str]]]:
        """Live pods of lower priority whose carve claims are allocated and theirs alone
        (evicting one user of a shared claim frees nothing)."""
        pods = stores[Kind.POD]
        in_hold = {v for k in self._held_pods() for v in k}
        now = self._wall()
        out: list[Candidate] = []
        claims_of: dict[str, list[str]] = {}
        for key, node, held in self._index(pods):
            p = pods.get(key)
            if p is None or key == preemptor or key in in_hold:
                continue
            view = PodView(p)
            if view.deleting or view.priority >= prio:
                continue
            started = _parse_time(view.start_time)
            running = max(0.0, (now - started).total_seconds()) if started else 0.0
            out.append(Candidate(key, node, view.priority, running))
            claims_of[key] = held
        return out, claims_of

    def _index(self, pods: Mapping[str, Obj]) -> list[tuple[str, str, list[str]]]:
        """(pod, node, claims) of every pod holding carve claims of its own, rebuilt only when
        the model changed: every unplaceable pod asks, and a scan of all pods each time would
        make a pass quadratic in the pending pods."""
        version = (self._planner.model.version, len(pods))
        if self._index_cache is not None and self._index_cache[0] == version:
            return self._index_cache[1]
        users: dict[str, int] = {}
        uses: dict[str, list[str]] = {}
        for key, p in pods.items():
            view = PodView(p)
            if view.terminal:
                continue
            ns = view.namespace
            names = [f"{ns}/{n}" for n in pod_claim_names(p)[0]]
            uses[key] = names
            for n in names:
                users[n] = users.get(n, 0) + 1
        index: list[tuple[str, str, list[str]]] = []
        for key, names in uses.items():
            held = [n for n in names if self._planner.claim_key(n) is not None]
            if not held or any(users[n] > 1 for n in held):
                continue
            node = self._node_of(pods[key], held)
            if node is not None:
                index.append((key, node, held))
        self._index_cache = (version, index)
        return index

    def _held_pods(self) -> list[tuple[str, ...]]:
        return [r[1] for r in self._planner.reservations()]

    def _node_of(self, pod: Obj, claims: Sequence[str]) -> str | None:
        node = PodView(pod).node_name
        if node:
            return node
        for c in claims:
            ck = self._planner.claim_key(c)
            hold = self._planner.model.hold_of(ck) if ck is not None else None
            if hold is not None and hold.node:
                return hold.node
        return None

    def _budgets(
        self, candidates: Sequence[Candidate], stores: Mapping[Kind, Mapping[str, Obj]]
    ) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
        """Budgets the disruption controller has observed: how many pods each still lets go,
        and which budgets cover each candidate."""
        pods = stores[Kind.POD]
        allowances: dict[str, int] = {}
        budgets_of: dict[str, tuple[str, ...]] = {}
        for ns in sorted({c.pod.split("/", 1)[0] for c in candidates}):
            try:
                pdbs = self._evictor.disruption_budgets(ns)
            except Exception as exc:  # the Eviction API still enforces them
                _log.info("could not list PodDisruptionBudgets in %s: %s", ns, exc)
                continue
            for pdb in pdbs:
                budget = ObjectView(pdb)
                status = budget.status
                if int(status.get("observedGeneration") or 0) < budget.generation:
                    continue  # not evaluated yet: the dry run will tell
                name = f"{ns}/{budget.name}"
                allowances[name] = int(status.get("disruptionsAllowed") or 0)
                selector = budget.spec.get("selector")
                for c in candidates:
                    labels = ObjectView(pods[c.pod]).labels
                    if c.pod.startswith(f"{ns}/") and label_selector_matches(selector, labels):
                        budgets_of[c.pod] = (*budgets_of.get(c.pod, ()), name)
        return allowances, budgets_of

    # -- evictions -----------------------------------------------------------------------------

    def _dry_run(
        self, chosen: VictimSet, stores: Mapping[Kind, Mapping[str, Obj]]
    ) -> dict[str, str]:
        blocked: dict[str, str] = {}
        for v in chosen.victims:
            try:
                res = self._evictor.evict(stores[Kind.POD][v.pod], dry_run=True)
            except EvictionFencedError:
                raise
            except Exception as exc:
                blocked[v.pod] = describe_failure(exc)
                continue
            if res.outcome is not EvictionOutcome.EVICTED:
                blocked[v.pod] = res.message or res.outcome.value
        return blocked

    def _evict(
        self,
        pod: Obj,
        chosen: VictimSet,
        *,
        request: Any,
        claims_of: Mapping[str, Sequence[str]],
        stores: Mapping[Kind, Mapping[str, Obj]],
        checks: int,
    ) -> Unplaceable:
        key = key_of(pod)
        freed = [c for v in chosen.victims for c in claims_of[v.pod]]
        placement = self._planner.placement_without(request, chosen.node, freed, chosen.pods)
        target = (
            ", ".join(
                f"{c.profile} on GPU {c.gpu_uuid} at memory slice {c.start}"
                for c in placement.choices
            )
            if placement is not None
            else f"node {chosen.node}"
        )
        evicted: list[str] = []
        failed: list[str] = []
        for v in chosen.victims:
            victim = stores[Kind.POD][v.pod]
            try:
                res = self._evictor.evict(victim, dry_run=False)
            except EvictionFencedError:
                raise
            except Exception as exc:
                failed.append(f"{v.pod} ({describe_failure(exc)})")
                continue
            if res.outcome is EvictionOutcome.BLOCKED:
                failed.append(f"{v.pod} ({res.message})")
                continue
            evicted.append(v.pod)
            self._recorder.event(
                victim,
                Kind.POD,
                "Warning",
                "Preempted",
                f"preempted by pod {key} (priority {PodView(pod).priority} > {v.priority}), "
                f"which needs {target} on node {chosen.node}; evicted through the Eviction API",
            )
        self._planner.reserve(
            key,
            chosen.node,
            evicted,
            [c for p in evicted for c in claims_of[p]],
            self._cfg.hold_s,
        )
        who = (
            ", ".join(
                f"{v.pod} (priority {v.priority}, ran {v.running_s:.0f}s)"
                for v in chosen.victims
                if v.pod in evicted
            )
            or "nobody"
        )
        message = (
            f"preempting on node {chosen.node}: evicted {who}, the cheapest of the lower-priority "
            f"sets that free {target} ({checks} sets examined); their slices are held for this "
            f"pod for {self._cfg.hold_s:.0f}s"
        )
        if failed:
            message += f"; the Eviction API then refused {', '.join(failed)}"
        _log.info("pod %s: %s", key, message, extra={"pod": key, "node": chosen.node})
        return Unplaceable("Preempting", message)
