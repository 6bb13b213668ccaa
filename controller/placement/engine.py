"""`PlacementEngine`: one decision, from a pod's claims to a placement or a refusal.

The engine validates the request (classes exist, selectors compile), expands ``firstAvailable``
into combinations of alternatives in order of preference (the first combination that fits
anywhere wins, as in kube-scheduler), turns each combination into request slots, hands them to
the search, and turns the answer into API-shaped choices or a refusal in words. The modules
beside it each hold one concern: :mod:`.eligibility` (which devices a request may use),
:mod:`.scoring` (the packing policy), :mod:`.search` (finding placements), :mod:`.explain`
(refusals).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from decimal import Decimal

from controller.claims import AllocationMode, DeviceClass, ExactRequest
from controller.model import WHOLE_GPU, ClusterModel
from controller.nodefit import PodNeeds
from controller.placement.eligibility import Eligibility, SelectorFailure
from controller.placement.explain import Explainer, Refusal
from controller.placement.records import Found, FoundDevice, ScopedConstraint, Slot
from controller.placement.scoring import (
    DEFAULT_POLICY,
    CandidateTable,
    GpuValues,
    Policy,
    packing_policy,
)
from controller.placement.search import NoEligibleDevice, NoFit, Searcher, SelectorFailed
from controller.placement.values import (
    MAX_COMBINATIONS,
    MAX_DEVICES_PER_POD,
    MAX_RESULTS_PER_CLAIM,
    DeviceChoice,
    NoPlacement,
    NoPlacementReason,
    Placement,
    PlacementRequest,
)
from driver.cel import SelectorEvaluator
from driver.contract import DEFAULT_DRIVER_NAME


class PlacementEngine:
    """Chooses placements; see the package docstring. Not thread-safe (one decision at a time).

    Pure: :meth:`place` reads the model and never changes it. ``policy`` is fixed at
    construction (its caches are built for it).
    """

    def __init__(
        self,
        model: ClusterModel,
        classes: Mapping[str, DeviceClass],
        driver: str = DEFAULT_DRIVER_NAME,
        *,
        policy: Policy = DEFAULT_POLICY,
        evaluator: SelectorEvaluator | None = None,
        search_budget: int = 20_000,
    ) -> None:
        self.model = model
        self.driver = driver
        self.policy = policy
        self.evaluator = evaluator or SelectorEvaluator()
        self._eligibility = Eligibility(classes, driver, self.evaluator)
        values = GpuValues()
        packing = packing_policy(policy, model)
        self._search = Searcher(
            model,
            self._eligibility,
            policy=packing,
            values=values,
            candidates=CandidateTable(packing, values),
            budget=search_budget,
        )
        self._explainer = Explainer(model, self._eligibility)

    @property
    def classes(self) -> Mapping[str, DeviceClass]:
        """The DeviceClasses by name; replaceable, or edited in place by the caller."""
        return self._eligibility.classes

    @classes.setter
    def classes(self, classes: Mapping[str, DeviceClass]) -> None:
        self._eligibility.classes = classes

    @property
    def search_budget(self) -> int:
        """Depth-first steps per node signature before the search gives up on that node."""
        return self._search.budget

    @search_budget.setter
    def search_budget(self, budget: int) -> None:
        self._search.budget = budget

    # ------------------------------------------------------------------------------------------
    # Entry points

    def place(self, request: PlacementRequest) -> Placement | NoPlacement:
        """The best placement for all of the pod's claims, or why there is none."""
        problem = self._check_request(request)
        if problem is not None:
            return problem
        if not any(claim.spec.requests for claim in request.claims):
            return NoPlacement(
                NoPlacementReason.NO_MATCHING_DEVICE,
                "the pod has no device requests to place",
                permanent=True,
            )
        constraints = [
            ScopedConstraint(ci, c)
            for ci, claim in enumerate(request.claims)
            for c in claim.spec.constraints
        ]
        refusals: list[Refusal] = []
        for slots in itertools.islice(self._combinations(request), MAX_COMBINATIONS):
            result = self._place_slots(request, slots, constraints)
            if isinstance(result, Placement):
                return result
            if result.outcome.permanent:
                return result.outcome
            refusals.append(result)
        return self._explainer.combine(refusals)

    def commit(self, placement: Placement, pod: str, needs: PodNeeds) -> None:
        """Record a placement in the model as if its claims had been written and read back.

        The controller does not call this: its planner feeds the model from the API (the
        claims it writes are observed as the server returns them, the pod's requests when the
        plan is committed), so the model only ever holds what the API holds. Simulations
        without an API server (``bench/packing.py``, the tests) call it instead.
        """
        for hold in placement.holds():
            self.model.hold(hold)
        self.model.set_pod(pod, placement.node, needs.requests)

    def largest_capacity(self, spec: ExactRequest, name: str) -> Decimal | None:
        """The largest amount of capacity ``name`` among the published devices that the
        (sub)request's class and selectors match anywhere, or None if none matches.

        Used to word a refusal (is a capacity floor what leaves nothing?), so it runs only
        after a decision failed; selector errors count as no match (they are reported first).
        """
        largest: Decimal | None = None
        for gpu in self.model.gpus.values():
            eligible = self._eligibility.eligible(spec, gpu)
            if isinstance(eligible, SelectorFailure):
                return None
            for placement in eligible:
                device = gpu.by_placement.get(placement)
                have = dict(device.facts.capacity).get(name) if device is not None else None
                if have is not None and (largest is None or have > largest):
                    largest = have
        return largest

    # ------------------------------------------------------------------------------------------
    # Steps of a decision

    def _check_request(self, request: PlacementRequest) -> NoPlacement | None:
        """Refusals no capacity change can lift: an unknown class, a selector that does not
        compile. Checked before any search, so they are reported even with no GPU around."""
        missing = sorted(
            {
                name
                for c in request.claims
                for name in c.spec.device_classes()
                if name not in self.classes
            }
        )
        if missing:
            return NoPlacement(
                NoPlacementReason.UNKNOWN_DEVICE_CLASS,
                f"DeviceClass {', '.join(missing)} does not exist",
                permanent=True,
            )
        for c in request.claims:
            for r in c.spec.requests:
                for a in r.alternatives:
                    failure = self._eligibility.compile_failure(a.spec)
                    if failure is not None:
                        return failure.refusal(c.key, a.result_name)
        return None

    @staticmethod
    def _combinations(request: PlacementRequest) -> Iterator[list[Slot]]:
        """firstAvailable: one choice of alternative per request, in order of preference
        (lexicographic, as kube-scheduler), each expanded into one slot per device (one for
        allocationMode All, which takes every matching device of the node)."""
        per_request = [
            (ci, claim, r) for ci, claim in enumerate(request.claims) for r in claim.spec.requests
        ]
        for combo in itertools.product(*(r.alternatives for _, _, r in per_request)):
            slots: list[Slot] = []
            for (ci, claim, r), alt in zip(per_request, combo, strict=True):
                n = 1 if alt.spec.mode is AllocationMode.ALL else alt.spec.count
                slots.extend(Slot(ci, claim.key, r.name, alt) for _ in range(n))
            yield slots

    def _place_slots(
        self, request: PlacementRequest, slots: list[Slot], constraints: list[ScopedConstraint]
    ) -> Placement | Refusal:
        """One combination: the single-device fast path when nothing ties the slot to a node
        or to other devices, else the general search."""
        if len(slots) > MAX_DEVICES_PER_POD:
            return Refusal(
                NoPlacement(
                    NoPlacementReason.INSUFFICIENT_DEVICES,
                    f"the pod asks for {len(slots)} devices; the controller places at most "
                    f"{MAX_DEVICES_PER_POD} per pod",
                )
            )
        single = (
            len(slots) == 1
            and not slots[0].all_mode
            and not any(c.covers(slots[0]) for c in constraints)
            and not self._eligibility.identity_dependent(slots[0].alternative.spec)
            and request.node is None
        )
        if single:
            outcome = self._search.place_single(request.needs, slots[0])
        else:
            outcome = self._search.place_general(request.needs, request.node, slots, constraints)
        if isinstance(outcome, Found):
            return self._placement(outcome)
        if isinstance(outcome, SelectorFailed):
            slot = outcome.slot
            return Refusal(outcome.failure.refusal(slot.claim, slot.alternative.result_name))
        if isinstance(outcome, NoEligibleDevice):
            return self._explainer.no_device(outcome.slot)
        assert isinstance(outcome, NoFit)
        return self._explainer.no_fit(
            request.node, slots, outcome.misfits, exhausted=outcome.exhausted
        )

    def _placement(self, found: Found) -> Placement | Refusal:
        """API-shaped choices, unless a claim would get more results than an allocation holds
        (an API limit that allocationMode All can exceed on a large node)."""
        choices = tuple(self._choice(d) for d in found.devices)
        for claim, n in sorted(Counter(c.claim for c in choices).items()):
            if n > MAX_RESULTS_PER_CLAIM:
                return Refusal(
                    NoPlacement(
                        NoPlacementReason.INSUFFICIENT_DEVICES,
                        f"claim {claim} would get {n} devices; an allocation holds at most "
                        f"{MAX_RESULTS_PER_CLAIM}",
                    )
                )
        return Placement(found.node, choices, found.loss)

    def _choice(self, found: FoundDevice) -> DeviceChoice:
        gpu, pid = found.gpu, found.profile_id
        device = gpu.by_placement[(pid, found.start)]
        profile = "gpu" if pid == WHOLE_GPU else gpu.inventory.model.profile_by_id(pid).name
        return DeviceChoice(
            claim=found.slot.claim,
            request=found.slot.alternative.result_name,
            driver=self.driver,
            pool=gpu.inventory.pool,
            device=device.name,
            node=gpu.node,
            gpu_uuid=gpu.uuid,
            profile_id=pid,
            start=found.start,
            profile=profile,
        )
