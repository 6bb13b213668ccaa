"""The placement engine behind the reconciler's `Planner` seam: API objects in, typed model out.

The engine (`controller.placement`, `controller.model`) works on typed values; this adapter keeps
its `ClusterModel` in step with what the informers deliver and translates one pod's claims into
a `PlacementRequest` and the answer back into `ClaimAllocation`s for the writer.

Bad input is contained here (invariant 5): a malformed Node, Pod, ResourceSlice pool, claim or
class is logged and left out of the model (or reported as the pod's `Unplaceable` reason), never
raised into the reconciler, so one bad object cannot stop allocation for everybody else.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from controller.claims import (
    ClaimHold,
    ClaimKey,
    ClaimSpecError,
    DeviceClass,
    parse_claim_hold,
    parse_claim_spec,
    parse_device_class,
)
from controller.model import ClusterModel
from controller.mpscheck import (
    ClaimMps,
    MpsSettingError,
    allocated_mps,
    check_clients,
    check_one_daemon,
    claim_floors,
    floor_refusal,
    pod_clients,
    spec_mps,
    with_floors,
)
from controller.nodefit import PodNeeds, PodSpecError, parse_node, parse_pod_needs, pod_requests
from controller.objects import (
    ClaimAllocation,
    Kind,
    Plan,
    Problem,
    Unplaceable,
    key_of,
    pod_claim_refs,
)
from controller.placement import (
    DEFAULT_POLICY,
    ClaimToPlace,
    NoPlacement,
    Placement,
    PlacementEngine,
    PlacementRequest,
    Policy,
)
from controller.skew import NodeSkew
from controller.taintrules import TaintRules
from controller.whatif import WhatIf
from driver.allocation import AllocatedDevice
from driver.apiviews import ClaimView, ObjectView, PodView, SliceView
from driver.cel import qualify
from driver.contract import DEFAULT_DRIVER_NAME
from process.kube import Obj

_log = logging.getLogger(__name__)

_SHARED_REFUSAL_S = 1.0
"""How long a refusal is shared by identical requests while nothing in the model changes."""


@dataclass(frozen=True, eq=False)
class _Shape:
    """A request's shape (`_request_shape`) with its hash worked out once: a waiting pod's
    shape is looked up after every change, and hashing the nested claim specs again each time
    was the largest part of a visit that shares a refusal."""

    parts: tuple[Hashable, ...]
    digest: int

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Shape) and self.digest == other.digest and self.parts == other.parts
        )


def _request_shape(
    request: PlacementRequest,
    to_place: Sequence[ClaimToPlace],
    floors: Mapping[tuple[ClaimKey, str], int],
) -> _Shape | None:
    """Everything the engine and the floor check read of a request, without the pod's and
    the claims' names (which only the messages carry); None if a part is not hashable."""
    position = {c.key: i for i, c in enumerate(to_place)}
    parts = (
        request.pod.partition("/")[0],  # namespace
        request.needs,
        request.node,
        tuple(c.spec for c in request.claims),
        tuple(c.spec for c in to_place),
        tuple(sorted((position[ck], result, n) for (ck, result), n in floors.items())),
    )
    try:
        return _Shape(parts, hash(parts))
    except TypeError:
        return None


_Built = tuple[PlacementRequest, list[ClaimToPlace], dict[tuple[ClaimKey, str], int]]


@dataclass(frozen=True)
class _ReadRequest:
    pod: Obj
    claims: tuple[Obj, ...]
    classes: int  # EnginePlanner._class_version it was read with
    built: _Built | Unplaceable
    shape: _Shape | None


@dataclass
class _Reservation:
    """Slices freed by preemption, held for one pod until it is placed (or the hold ends).

    ``waiting`` are the victims' claims (store key -> model key) still allocated; once one is
    released its hold stays in the model as a *ghost* (in ``ghosts``), so no other pod can be
    given those slices. The preemptor's own decision releases the ghosts and places at once.
    """

    node: str
    victims: tuple[str, ...]
    waiting: dict[str, ClaimKey]
    expires_at: float
    ghosts: dict[ClaimKey, ClaimHold] = field(default_factory=dict)


class EnginePlanner(WhatIf):
    """`Planner` backed by `PlacementEngine` (its policy: `DEFAULT_POLICY` unless told); its
    what-ifs (preemption, a release in flight) are `controller.whatif`'s."""

    def __init__(
        self,
        driver: str = DEFAULT_DRIVER_NAME,
        policy: Policy = DEFAULT_POLICY,
        *,
        clock: Callable[[], float] = time.monotonic,
        shared_refusal_s: float = _SHARED_REFUSAL_S,
    ) -> None:
        """`shared_refusal_s`: how long identical requests share a refusal while the model
        does not change (see `plan`); 0 decides every pod afresh."""
        self.driver = driver
        self._clock = clock
        self._shared_refusal_s = shared_refusal_s
        self._reservations: dict[str, _Reservation] = {}  # preemptor pod key -> its hold
        self.model = ClusterModel()
        self._classes: dict[str, DeviceClass] = {}
        self._bad_classes: dict[str, str] = {}
        self.engine = PlacementEngine(self.model, self._classes, driver, policy=policy)
        self._slices: dict[str, dict[str, Obj]] = {}  # node -> slice name -> slice
        self._rules = TaintRules(driver)  # the DeviceTaintRules, applied as slices are read
        self._skew = NodeSkew(driver)  # nodes whose slices are not read (controller.skew)
        self._claim_keys: dict[str, ClaimKey] = {}
        self._pinned: dict[str, str] = {}  # pod key -> node chosen by us, until bound
        # Nodes whose slices changed since the last decision. A node publishes several slices
        # at once (counters, devices per GPU); re-reading its pool once per decision instead of
        # once per slice event keeps start-up linear in the number of slices.
        self._dirty_nodes: set[str] = set()
        # Refusals that identical requests share (see `plan`): request shape -> the refusal's
        # reason, valid while the model is unchanged (every change empties it) and at most
        # _SHARED_REFUSAL_S, so a reason that time alone changes is not kept for long.
        self._refused: dict[_Shape, str] = {}
        # `fits_after_release` answers by request shape, also emptied by every change.
        self._release_fits: dict[tuple[_Shape, frozenset[str]], bool] = {}
        self._refused_since = 0.0
        # One object for equal shapes (by digest), so that looking a like pod's shape up in
        # `_refused` compares by identity, not field by field; an entry lives while a kept
        # request holds its shape.
        self._shapes: weakref.WeakValueDictionary[int, _Shape] = weakref.WeakValueDictionary()
        # Each waiting pod's request as last read (`_read_request`), and what it was read with.
        self._requests: dict[str, _ReadRequest] = {}
        self._class_version = 0

    # -- model feed -------------------------------------------------------------------------------

    def observe(self, kind: Kind, obj: Obj) -> None:
        self._model_changed()
        try:
            self._observe(kind, obj)
        except (ValueError, KeyError, TypeError) as exc:
            _log.warning("ignoring malformed %s %s: %s", kind, key_of(obj), exc)

    def _observe(self, kind: Kind, obj: Obj) -> None:
        key = key_of(obj)
        if kind is Kind.NODE:
            self.model.set_node(parse_node(obj))
        elif kind is Kind.POD:
            self._observe_pod(key, obj)
        elif kind is Kind.SLICE:
            piece = SliceView(obj)
            node = piece.node_name
            if node and piece.driver == self.driver:
                self._slices.setdefault(node, {})[key] = obj
                self._dirty_nodes.add(node)
        elif kind is Kind.CLAIM:
            self._observe_claim(key, obj)
        elif kind is Kind.TAINT_RULE:
            self._dirty_nodes |= self._rules.observe(obj, self._slices)
        elif kind is Kind.CLASS:
            self._class_version += 1
            name = ObjectView(obj).name
            try:
                self._classes[name] = parse_device_class(obj, self.driver)
                self._bad_classes.pop(name, None)
            except ClaimSpecError as exc:
                self._classes.pop(name, None)
                self._bad_classes[name] = str(exc)

    def _observe_pod(self, key: str, pod: Obj) -> None:
        view = PodView(pod)
        node: str | None = view.node_name
        if node or view.terminal or view.deleting:
            self.drop_reservation(key)
        if view.terminal:
            self._pinned.pop(key, None)
            self._requests.pop(key, None)
            self.model.remove_pod(key)
            return
        if node:
            self._pinned.pop(key, None)
        else:
            node = self._pinned.get(key)
        if node:
            try:
                requests = pod_requests(view.spec)
            except PodSpecError as exc:
                _log.warning("pod %s has malformed requests: %s", key, exc)
                return
            self.model.set_pod(key, node, requests)
        else:
            self.model.remove_pod(key)

    def _observe_claim(self, key: str, claim: Obj) -> None:
        try:
            hold = parse_claim_hold(claim, self.driver)
        except ClaimSpecError as exc:
            # A malformed allocation (only a misbehaving client writes one: the apiserver
            # validates results) may still hold devices: keep what the model had, never free it.
            _log.warning("claim %s has a malformed allocation, keeping its devices: %s", key, exc)
            return
        old = self._claim_keys.get(key)
        if hold is None:
            if old is not None:
                del self._claim_keys[key]
                if not self._keep_as_ghost(key, old):
                    self.model.release(old)
            return
        if old is not None and old != hold.claim:
            self.model.release(old)
        self._claim_keys[key] = hold.claim
        self.model.hold(hold)

    def flush(self) -> None:
        """Bring every node whose slices changed up to date in the model."""
        dirty, self._dirty_nodes = self._dirty_nodes, set()
        for node in sorted(dirty):
            try:
                self._refresh_node_gpus(node)
            except (ValueError, KeyError, TypeError) as exc:
                _log.warning("ignoring malformed slices of node %s: %s", node, exc)

    def _refresh_node_gpus(self, node: str) -> None:
        slices = self._slices.get(node, {})
        self.model.set_node_gpus(node, self._skew.inventories(node, slices, self._rules.taints))

    def contract_skew(self) -> Mapping[str, str]:
        self.flush()
        return self._skew.skewed

    def forget(self, kind: Kind, obj: Obj) -> None:
        self._model_changed()
        key = key_of(obj)
        if kind is Kind.NODE:
            self.model.remove_node(ObjectView(obj).name)
        elif kind is Kind.POD:
            self._pinned.pop(key, None)
            self._requests.pop(key, None)
            self.model.remove_pod(key)
            self.drop_reservation(key)
        elif kind is Kind.SLICE:
            node = SliceView(obj).node_name
            if node and key in self._slices.get(node, {}):
                del self._slices[node][key]
                self._dirty_nodes.add(node)
        elif kind is Kind.CLAIM:
            old = self._claim_keys.pop(key, None)
            if old is not None and not self._keep_as_ghost(key, old):
                self.model.release(old)
        elif kind is Kind.TAINT_RULE:
            self._dirty_nodes |= self._rules.forget(obj, self._slices)
        elif kind is Kind.CLASS:
            self._class_version += 1
            name = ObjectView(obj).name
            self._classes.pop(name, None)
            self._bad_classes.pop(name, None)

    # -- preemption: what-if on the model, and the hold -----------------------------------------

    def claim_key(self, store_key: str) -> ClaimKey | None:
        """The model's key of an allocated claim (``namespace/name`` in the stores)."""
        return self._claim_keys.get(store_key)

    def reserve(
        self, pod_key: str, node: str, victims: Sequence[str], claims: Iterable[str], hold_s: float
    ) -> None:
        """Hold what the evicted ``victims``' ``claims`` free for ``pod_key`` for ``hold_s``."""
        self.drop_reservation(pod_key)
        self._model_changed()
        waiting = {k: ck for k in claims if (ck := self._claim_keys.get(k)) is not None}
        self._reservations[pod_key] = _Reservation(
            node, tuple(victims), waiting, self._clock() + hold_s
        )

    def reservation(self, pod_key: str) -> tuple[str, tuple[str, ...]] | None:
        """(node, victims) of the pod's hold, if it has one."""
        r = self._reservations.get(pod_key)
        return None if r is None else (r.node, r.victims)

    def reservations(self) -> list[tuple[str, tuple[str, ...]]]:
        """(node, victims) of every hold."""
        return [(r.node, r.victims) for r in self._reservations.values()]

    def drop_reservation(self, pod_key: str) -> None:
        """End a hold: the ghosts' slices are free for everybody again."""
        r = self._reservations.pop(pod_key, None)
        if r is None:
            return
        self._model_changed()
        for ck in r.ghosts:
            self.model.release(ck)
        if r.ghosts:
            _log.info("hold for pod %s ended; %d freed claim(s) released", pod_key, len(r.ghosts))

    def _keep_as_ghost(self, store_key: str, claim: ClaimKey) -> bool:
        for r in self._reservations.values():
            if r.waiting.get(store_key) == claim:
                del r.waiting[store_key]
                hold = self.model.hold_of(claim)
                if hold is not None:
                    r.ghosts[claim] = hold
                return True
        return False

    def _expire_reservations(self) -> None:
        if not self._reservations:
            return
        now = self._clock()
        for key in [k for k, r in self._reservations.items() if r.expires_at <= now]:
            _log.info("hold for pod %s expired", key, extra={"pod": key})
            self.drop_reservation(key)

    def _take_reservation(self, pod_key: str) -> Unplaceable | None:
        """For the preemptor: wait while victims still hold slices, else free the ghosts so
        this decision (and only this one, it runs before any other) can use them."""
        r = self._reservations.get(pod_key)
        if r is None:
            return None
        if r.waiting:
            return Unplaceable(
                "PreemptionPending",
                f"waiting for the slices of the preempted pod(s) {', '.join(r.victims)} on node "
                f"{r.node} to be released; they are held for this pod",
            )
        self.drop_reservation(pod_key)
        return None

    # -- decisions --------------------------------------------------------------------------------

    def plan(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        classes: Mapping[str, Obj],
        told: Unplaceable | None = None,
    ) -> Plan | Unplaceable:
        """The pod's placement, or why there is none.

        `told`: the refusal this pod was given last. When a pod with the same request was
        refused for the same reason since the model last changed, the engine would refuse
        this one too (it reads nothing of a pod but its request), so `told` itself comes
        back and no search is made. A full cluster's queue of like pods is then one search
        per kind of request after each change, not one per pod."""
        self.flush()
        self._expire_reservations()
        held = self._take_reservation(key_of(pod))
        if held is not None:
            return held
        read = self._read_request(pod, claims)
        if isinstance(read.built, Unplaceable):
            return read.built
        request, to_place, floors = read.built
        shape = read.shape
        if told is not None and not told.permanent and self._refusal_of(shape) == told.reason:
            return told
        result = self.engine.place(request)
        if isinstance(result, NoPlacement):
            verdict = self._floor_refusal(to_place, floors) or Unplaceable(
                str(result.reason), result.message, result.permanent
            )
            if not verdict.permanent and shape is not None and self._shared_refusal_s > 0:
                self._share_refusal(shape, verdict.reason)
            return verdict
        return self._plan_of(result, to_place)

    def _read_request(self, pod: Obj, claims: Sequence[Obj]) -> _ReadRequest:
        """`_request`, read again only when the pod, a claim (new objects: the stores replace,
        never edit) or a DeviceClass changed: a queue is visited after every change, and
        reading a request was most of what visiting a waiting pod cost. Only unallocated
        claims' requests are kept: an allocated claim's is read from the model too."""
        key = key_of(pod)
        kept = self._requests.get(key)
        if (
            kept is not None
            and kept.pod is pod
            and kept.classes == self._class_version
            and len(kept.claims) == len(claims)
            and all(a is b for a, b in zip(kept.claims, claims, strict=True))
        ):
            return kept
        built = self._request(pod, claims)
        shape = None if isinstance(built, Unplaceable) else self._one_shape(_request_shape(*built))
        read = _ReadRequest(pod, tuple(claims), self._class_version, built, shape)
        if any(ClaimView(c).allocated for c in claims):
            self._requests.pop(key, None)
        else:
            self._requests[key] = read
        return read

    def _one_shape(self, shape: _Shape | None) -> _Shape | None:
        if shape is None:
            return None
        kept = self._shapes.get(shape.digest)
        if kept is not None and kept == shape:
            return kept
        self._shapes[shape.digest] = shape
        return shape

    def _model_changed(self) -> None:
        if self._refused:
            self._refused.clear()
        if self._release_fits:
            self._release_fits.clear()

    def fits_after_release(
        self, pod: Obj, claims: Sequence[Obj], released: Collection[str]
    ) -> bool:
        """`WhatIf.fits_after_release`, answered once per request shape while the model is
        unchanged: a queue of like pods costs one what-if per node, not one per pod."""
        self.flush()
        shape = self._read_request(pod, claims).shape
        if shape is None:
            return super().fits_after_release(pod, claims, released)
        key = (shape, frozenset(released))
        if key not in self._release_fits:
            self._release_fits[key] = super().fits_after_release(pod, claims, released)
        return self._release_fits[key]

    def _refusal_of(self, shape: _Shape | None) -> str | None:
        if shape is None or not self._refused:
            return None
        if self._clock() - self._refused_since > self._shared_refusal_s:
            self._refused.clear()
            return None
        return self._refused.get(shape)

    def _share_refusal(self, shape: _Shape, reason: str) -> None:
        if not self._refused:
            self._refused_since = self._clock()
        self._refused[shape] = reason

    def placement_request(self, pod: Obj, claims: Sequence[Obj]) -> PlacementRequest | Unplaceable:
        """What `plan` would ask the engine for this pod (for the preemption search)."""
        self.flush()
        built = self._read_request(pod, claims).built  # plan just read it, as a rule
        return built if isinstance(built, Unplaceable) else built[0]

    def _request(
        self, pod: Obj, claims: Sequence[Obj]
    ) -> tuple[PlacementRequest, list[ClaimToPlace], dict[tuple[ClaimKey, str], int]] | Unplaceable:
        pod_key = key_of(pod)
        try:
            needs: PodNeeds = parse_pod_needs(pod)
        except PodSpecError as exc:
            return Unplaceable("InvalidPod", f"pod {pod_key}: {exc}", permanent=True)
        to_place: list[ClaimToPlace] = []
        pinned: set[str] = set()
        mps: dict[str, ClaimMps] = {}
        for claim in claims:
            ckey = key_of(claim)
            try:
                hold = parse_claim_hold(claim, self.driver)
            except ClaimSpecError as exc:
                return Unplaceable("InvalidClaim", f"ResourceClaim {ckey}: {exc}", permanent=True)
            view = ClaimView(claim)
            if hold is not None:
                if hold.node:
                    pinned.add(hold.node)
                mps[view.name] = self._allocated_mps(claim, hold)
                continue
            for name in view.class_names:
                if name in self._bad_classes:
                    return Unplaceable(
                        "InvalidDeviceClass",
                        f"DeviceClass {name} is invalid: {self._bad_classes[name]}",
                        permanent=True,
                    )
            try:
                spec = parse_claim_spec(claim.get("spec") or {}, self.driver)
                settings = spec_mps(spec, self._classes, self.driver)
                check_one_daemon(spec, settings)
            except ClaimSpecError as exc:
                return Unplaceable("InvalidClaim", f"ResourceClaim {ckey}: {exc}", permanent=True)
            except MpsSettingError as exc:
                return Unplaceable(
                    "InvalidMpsSettings", f"ResourceClaim {ckey}: {exc}", permanent=True
                )
            mps[view.name] = ClaimMps(view.name, settings)
            to_place.append(ClaimToPlace(ClaimKey(view.namespace, view.name, view.uid), spec))
        if len(pinned) > 1:
            return Unplaceable(
                "ClaimsOnDifferentNodes",
                f"the pod's claims are already allocated on different nodes: {sorted(pinned)}",
                permanent=True,
            )
        client_floors = self._check_clients(pod, mps)
        if isinstance(client_floors, Unplaceable):
            return client_floors
        floored, floors = self._floored(to_place, mps, client_floors)
        node = next(iter(pinned), None) or PodView(pod).node_name or None
        return PlacementRequest(pod_key, needs, tuple(floored), node), to_place, floors

    def check_allocated(self, pod: Obj, claims: Sequence[Obj]) -> Unplaceable | None:
        self.flush()
        conflict = self._conflict_of(claims)
        if conflict is not None:
            return conflict
        mps: dict[str, ClaimMps] = {}
        for claim in claims:
            try:
                hold = parse_claim_hold(claim, self.driver)
            except ClaimSpecError:
                continue  # reported where the claim is placed or prepared
            if hold is not None:
                mps[ClaimView(claim).name] = self._allocated_mps(claim, hold)
        checked = self._check_clients(pod, mps)
        return checked if isinstance(checked, Unplaceable) else None

    def _conflict_of(self, claims: Sequence[Obj]) -> Unplaceable | None:
        """A pod whose claim shares a device with another claim (another allocator's write, or
        a dead leader's) stays gated until one claim is left: it would start on a slice that
        is not its own (issue 41.4). The claims are told by `controller.conflicts`."""
        names = {f"{ClaimView(c).namespace}/{ClaimView(c).name}" for c in claims}
        for problem in self.model.problems.values():
            if hit := sorted(names.intersection(problem.claims)):
                return Unplaceable(
                    "AllocationConflict",
                    f"claim {hit[0]} is in an allocation conflict ({problem.message}); carve "
                    "keeps the pod gated until only one claim holds the device",
                )
        return None

    def _check_clients(
        self, pod: Obj, mps: Mapping[str, ClaimMps]
    ) -> dict[tuple[str, str], int] | Unplaceable:
        """A container's own MPS limits against the claims it uses (``controller.mpscheck``)."""
        try:
            return check_clients(pod_clients(pod, pod_claim_refs(pod)), mps)
        except MpsSettingError as exc:
            return Unplaceable("InvalidMpsSettings", f"pod {key_of(pod)}: {exc}", permanent=True)

    def _allocated_mps(self, claim: Obj, hold: ClaimHold) -> ClaimMps:
        """An allocated claim's MPS results and their slices' memory, from the model."""
        memory: dict[str, int] = {}
        capacity = qualify(self.driver, "memory")
        for d in hold.devices:
            found = self.model.device(d.pool, d.device)
            have = dict(found[1].facts.capacity).get(capacity) if found is not None else None
            if have is not None:
                memory[d.request] = int(have)
        return ClaimMps(ClaimView(claim).name, allocated_mps(claim, self.driver), memory)

    def _floored(
        self,
        to_place: Sequence[ClaimToPlace],
        mps: Mapping[str, ClaimMps],
        client_floors: Mapping[tuple[str, str], int],
    ) -> tuple[list[ClaimToPlace], dict[tuple[ClaimKey, str], int]]:
        """The claims with MPS memory floors applied, and the floors by (claim, result)."""
        floors: dict[tuple[ClaimKey, str], int] = {}
        out = []
        for c in to_place:
            own = claim_floors(mps[c.key.name].mps)
            for (name, result), floor in client_floors.items():
                if name == c.key.name:
                    own[result] = max(own.get(result, 0), floor)
            floors.update({(c.key, result): floor for result, floor in own.items()})
            out.append(replace(c, spec=with_floors(c.spec, own, self.driver)) if own else c)
        return out, floors

    def _floor_refusal(
        self, to_place: Sequence[ClaimToPlace], floors: Mapping[tuple[ClaimKey, str], int]
    ) -> Unplaceable | None:
        """When no placement was found: an MPS memory floor above every slice its request can
        match is the reason to give (the engine's own words would speak of capacity)."""
        capacity = qualify(self.driver, "memory")
        for c in to_place:
            for request in c.spec.requests:
                for alt in request.alternatives:
                    floor = floors.get((c.key, alt.result_name))
                    if floor is None:
                        continue
                    largest = self.engine.largest_capacity(alt.spec, capacity)
                    if largest is not None and largest < floor:
                        message = floor_refusal(str(c.key), alt.result_name, floor, largest)
                        return Unplaceable("MpsLimitTooLarge", message)
        return None

    def _plan_of(self, placement: Placement, claims: Sequence[ClaimToPlace]) -> Plan:
        by_claim: dict[ClaimKey, list[AllocatedDevice]] = {c.key: [] for c in claims}
        for c in placement.choices:
            found = self.model.device(c.pool, c.device)
            published = found[1] if found is not None else None
            by_claim.setdefault(c.claim, []).append(
                AllocatedDevice(
                    c.request,
                    c.driver,
                    c.pool,
                    c.device,
                    profile=c.profile,
                    # As kube-scheduler's allocator does: the device's binding conditions go
                    # into its result, or the scheduler would bind before the node carved.
                    binding_conditions=published.binding_conditions if published else (),
                    binding_failure_conditions=(
                        published.binding_failure_conditions if published else ()
                    ),
                )
            )
        return Plan(
            placement.node,
            tuple(
                ClaimAllocation(k.namespace, k.name, k.uid, placement.node, tuple(results))
                for k, results in by_claim.items()
            ),
        )

    def committed(self, pod: Obj, plan: Plan) -> None:
        """The plan is written (or being written): count the pod's requests on the node
        before it is bound."""
        key = key_of(pod)
        self._model_changed()
        self._requests.pop(key, None)
        self._pinned[key] = plan.node
        with contextlib.suppress(PodSpecError):
            self.model.set_pod(key, plan.node, pod_requests(PodView(pod).spec))

    def problems(self) -> Mapping[str, Problem]:
        self.flush()  # a slice change can resolve a hold onto a contested device
        return self.model.problems

    def duplicate_gpus(self) -> Mapping[tuple[str, str], str]:
        """(GPU UUID, a node whose publication of it is ignored) -> the node it counts on."""
        return self.model.duplicate_gpus

    def withdrawn(self, pod: Obj) -> None:
        """The plan's writes failed: the pod's requests count on no node until it is placed."""
        key = key_of(pod)
        self._model_changed()
        if self._pinned.pop(key, None) is not None:
            self.model.remove_pod(key)
