"""MIG-aware preemption: the cheapest set of lower-priority pods whose removal lets a pod fit.

Pure: the search knows nothing about MIG geometry or the API. It is handed the candidates (pods
that hold carve slices, with their priority, node and how long they have run) and a
``feasible(node, victims)`` oracle that answers whether the pending pod would fit on ``node`` if
exactly those victims were gone. The controller's oracle asks the placement engine on its own
model with the victims' claims released (``EnginePlanner.placement_without``), so a set is only
ever chosen when the freed slices really combine into a valid placement: the search never
reasons about slices itself, it cannot get the geometry wrong.

The cost of a set, compared lexicographically (cheapest first):

1. fewer victims;
2. a lower highest victim priority, then a lower sum of priorities;
3. less work lost (the victims' summed running time);
4. node name and pod keys, so equal costs always give the same answer.

Feasibility is monotone (removing more pods never removes a placement), which the search uses
twice: a node where even all candidates together do not free enough is skipped, and within one
set size a combination is checked only if it is cheaper than the best found so far. Because the
victim count comes first, the first set size with a feasible set holds the answer, and that set
has no feasible proper subset.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

NEVER = "Never"
"""``spec.preemptionPolicy`` value by which a pod forbids preempting others for itself."""


@dataclass(frozen=True)
class Candidate:
    """A running pod that may be evicted: it holds carve slices on ``node``.

    ``budgets`` names the PodDisruptionBudgets that cover the pod; a set may take at most a
    budget's ``disruptionsAllowed`` pods from it.
    """

    pod: str
    node: str
    priority: int
    running_s: float = 0.0
    budgets: tuple[str, ...] = ()


Cost = tuple[int, int, int, float, str, tuple[str, ...]]


@dataclass(frozen=True)
class VictimSet:
    node: str
    victims: tuple[Candidate, ...]

    @property
    def cost(self) -> Cost:
        return victim_cost(self.node, self.victims)

    @property
    def pods(self) -> tuple[str, ...]:
        return tuple(v.pod for v in self.victims)


@dataclass(frozen=True)
class SearchResult:
    """The cheapest feasible set (None: there is none within the limits), how many oracle
    calls it took, and whether the limits stopped the search before it was exhaustive."""

    chosen: VictimSet | None
    checks: int
    exhausted: bool = False


@dataclass(frozen=True)
class SearchLimits:
    """Bounds one decision: at most ``max_victims`` pods per set and ``max_checks`` oracle
    calls (each is one placement-engine decision)."""

    max_victims: int = 8
    max_checks: int = 2000


def victim_cost(node: str, victims: Sequence[Candidate]) -> Cost:
    ordered = sorted(victims, key=lambda c: c.pod)
    return (
        len(victims),
        max((v.priority for v in victims), default=-(2**31)),
        sum(v.priority for v in victims),
        # in pod-name order, so that one set costs the same however it was assembled
        # (float addition is not associative)
        math.fsum(v.running_s for v in ordered),
        node,
        tuple(v.pod for v in ordered),
    )


def eligible(candidates: Iterable[Candidate], preemptor_priority: int) -> list[Candidate]:
    """Only pods of strictly lower priority may be evicted, never equal or higher."""
    return [c for c in candidates if c.priority < preemptor_priority]


def _within_budgets(victims: Sequence[Candidate], allowances: Mapping[str, int]) -> bool:
    taken: dict[str, int] = {}
    for v in victims:
        for b in v.budgets:
            taken[b] = taken.get(b, 0) + 1
            if taken[b] > allowances.get(b, taken[b]):
                return False
    return True


def _contribution(c: Candidate) -> tuple[int, float, str]:
    return (c.priority, c.running_s, c.pod)


def cheapest_victims(
    preemptor_priority: int,
    candidates: Iterable[Candidate],
    feasible: Callable[[str, frozenset[str]], bool],
    *,
    allowances: Mapping[str, int] | None = None,
    limits: SearchLimits | None = None,
) -> SearchResult:
    """The cheapest set of eligible candidates, all on one node, that makes the pod fit."""
    limits = limits or SearchLimits()
    allowances = allowances or {}
    by_node: dict[str, list[Candidate]] = {}
    for c in eligible(candidates, preemptor_priority):
        by_node.setdefault(c.node, []).append(c)
    checks = 0
    viable: list[tuple[str, list[Candidate]]] = []
    for node in sorted(by_node):
        pool = sorted(by_node[node], key=_contribution)
        if checks >= limits.max_checks:
            return SearchResult(None, checks, exhausted=True)
        checks += 1
        if feasible(node, frozenset(c.pod for c in pool)):
            viable.append((node, pool))
    if not viable:
        return SearchResult(None, checks)
    largest = min(limits.max_victims, max(len(pool) for _, pool in viable))
    for size in range(1, largest + 1):
        best: VictimSet | None = None
        for node, pool in viable:
            if size > len(pool):
                continue
            for combo in itertools.combinations(pool, size):
                candidate = VictimSet(node, combo)
                if best is not None and candidate.cost >= best.cost:
                    continue
                if not _within_budgets(combo, allowances):
                    continue
                if checks >= limits.max_checks:
                    return SearchResult(best, checks, exhausted=True)
                checks += 1
                if feasible(node, frozenset(c.pod for c in combo)):
                    best = candidate
        if best is not None:
            return SearchResult(best, checks)
    return SearchResult(None, checks, exhausted=largest < max(len(p) for _, p in viable))


def may_preempt(pod_spec: Mapping[str, object]) -> bool:
    """``preemptionPolicy: Never`` forbids evicting others for this pod."""
    return pod_spec.get("preemptionPolicy") != NEVER


def label_selector_matches(
    selector: Mapping[str, object] | None, labels: Mapping[str, str]
) -> bool:
    """A metav1.LabelSelector against a pod's labels (PodDisruptionBudget ``spec.selector``).

    A null selector selects nothing and an empty one everything, as policy/v1 defines it.
    """
    if selector is None:
        return False
    match = selector.get("matchLabels") or {}
    if not isinstance(match, Mapping):
        return False
    if any(labels.get(str(k)) != str(v) for k, v in match.items()):
        return False
    for expr in selector.get("matchExpressions") or []:  # type: ignore[attr-defined]
        if not isinstance(expr, Mapping):
            return False
        key, op = str(expr.get("key")), expr.get("operator")
        values = {str(v) for v in expr.get("values") or []}
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True
