"""Refusals in words: why a pod cannot be placed, fit to be shown as it is in an event.

A refusal names what the user can act on: the nodes node fit turned away and why, and for each
request without room, per GPU model and profile, that no GPU has a free placement and how many
would once pods of which profile finish (e.g. "no H100-SXM5-80GB GPU has a free 3g.40gb
placement; 2 would after 1g.10gb pods finish"). Requests that share the same explanation are
named together in one clause ("ns/c requests a, b, c need a device each (...)"), and the
refusals of several ``firstAvailable`` combinations that fail the same way are merged into one
sentence, so a long refusal never repeats a clause once per request or per combination.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from controller.claims import ClaimKey, ExactRequest
from controller.model import WHOLE_GPU, ClusterModel, GpuRecord, Occupancy
from controller.nodefit import NodeMisfit
from controller.placement.cache import BoundedCache
from controller.placement.eligibility import Eligibility, SelectorFailure, taint_list
from controller.placement.feasibility import occupancy_after, profile_name
from controller.placement.records import DeviceSet, Slot
from controller.placement.values import NoPlacement, NoPlacementReason
from controller.tolerations import DeviceTaint
from driver.geometry import Geometry

_MAX_MESSAGES = 8
"""Distinct refusals shown when firstAvailable combinations fail in different ways."""


@dataclass(frozen=True)
class Clause:
    """One request of one claim that lacks room, and why (``hint``; may be empty)."""

    claim: ClaimKey
    result: str
    count: int
    hint: str


@dataclass(frozen=True)
class Refusal:
    """A refusal and, when it lists requests without room, the parts its message is made of,
    so that the refusals of several firstAvailable combinations can be merged clause by
    clause: ``outcome.message == f"{header}: {_render(clauses)}{tail}"``."""

    outcome: NoPlacement
    header: str | None = None
    clauses: tuple[Clause, ...] = ()
    tail: str = ""


class _Unmatched(NamedTuple):
    """No device in the cluster matches the request; ``text`` says which filter leaves none."""

    text: str


class _ProfileRoom(NamedTuple):
    """For one eligible profile on one GPU state: whether it fits now, else the name of a
    profile whose instances, once gone, would make room (None if none would)."""

    profile_id: int
    fits_now: bool
    freed_by: str | None


class Explainer:
    """Words refusals; reads the model and eligibility, changes nothing."""

    def __init__(self, model: ClusterModel, eligibility: Eligibility) -> None:
        self._model = model
        self._eligibility = eligibility
        self._rooms: BoundedCache[
            tuple[Geometry, Occupancy, DeviceSet], tuple[_ProfileRoom, ...]
        ] = BoundedCache()

    def no_device(self, slot: Slot) -> Refusal:
        """No published device matches the slot at all: say which filter leaves nothing."""
        what = self._eligibility.first_empty_filter(slot.alternative.spec, self._kinds())
        return Refusal(
            NoPlacement(
                NoPlacementReason.NO_MATCHING_DEVICE,
                f"claim {slot.claim}, request {slot.alternative.result_name}: {what}",
            )
        )

    def no_fit(
        self,
        pinned: str | None,
        slots: Sequence[Slot],
        misfits: Mapping[str, NodeMisfit | None],
        *,
        exhausted: bool = False,
    ) -> Refusal:
        """No node has room for all the slots: node-fit refusals, then what each request
        lacks (identical explanations named together)."""
        bad_nodes = {n: m for n, m in misfits.items() if m is not None}
        gpu_nodes = list(self._model.gpu_nodes()) if pinned is None else [pinned]
        if not gpu_nodes:
            return Refusal(NoPlacement(NoPlacementReason.NO_NODE, "no node publishes carve GPUs"))
        fit = len(gpu_nodes) - len(bad_nodes)
        if fit == 0:
            if len(bad_nodes) == 1:
                message = next(iter(bad_nodes.values())).message
            else:
                message = f"0/{len(gpu_nodes)} GPU nodes can take the pod: {_nodes(bad_nodes)}"
                message += _tail(exhausted)
            return Refusal(NoPlacement(NoPlacementReason.NODE_MISFIT, message))
        clauses = self._clauses(slots)
        if isinstance(clauses, Refusal):
            return clauses
        if len(slots) == 1 and not bad_nodes:
            header = "no free placement"
        else:
            header = f"0/{len(gpu_nodes)} GPU nodes can take the pod"
            if bad_nodes:
                header += f": {_nodes(bad_nodes)}"
            header += f"; {fit} node(s) lack room for all its devices"
        tail = _tail(exhausted)
        message = f"{header}: {_render(clauses)}{tail}"
        return Refusal(
            NoPlacement(NoPlacementReason.INSUFFICIENT_DEVICES, message), header, clauses, tail
        )

    @staticmethod
    def combine(refusals: Sequence[Refusal]) -> NoPlacement:
        """One refusal for several firstAvailable combinations that all failed.

        Combinations that list requests without room under the same header are merged into
        one sentence naming each (request, explanation) once; the distinct sentences are
        joined with " | "."""
        if len(refusals) == 1:
            return refusals[0].outcome
        sentences: dict[object, list[Refusal]] = {}
        for r in refusals:
            key = (r.header, r.tail) if r.header is not None and r.clauses else r.outcome.message
            sentences.setdefault(key, []).append(r)
        messages = []
        for group in sentences.values():
            first = group[0]
            if len(group) == 1 or first.header is None:
                messages.append(first.outcome.message)
                continue
            merged = {(c.claim, c.result, c.hint): c for r in group for c in r.clauses}
            text = _render(tuple(merged.values()), counted=False)
            messages.append(f"{first.header}: {text}{first.tail}")
        reason = refusals[0].outcome.reason
        return NoPlacement(reason, "no alternative fits: " + " | ".join(messages[:_MAX_MESSAGES]))

    def _clauses(self, slots: Sequence[Slot]) -> tuple[Clause, ...] | Refusal:
        """One clause per (claim, request) with its device count and capacity hint."""
        counts = Counter((s.claim, s.alternative.result_name) for s in slots)
        hints: dict[ExactRequest, str] = {}
        out = []
        for (claim, result), count in counts.items():
            slot = next(
                s for s in slots if s.claim == claim and s.alternative.result_name == result
            )
            spec = slot.alternative.spec
            hint = hints.get(spec)
            if hint is None:
                found = self._hint(spec)
                if isinstance(found, SelectorFailure):
                    return Refusal(found.refusal(claim, result))
                if isinstance(found, _Unmatched):
                    # Not a lack of room: nothing in the cluster matches, as on the
                    # single-device path.
                    message = f"claim {claim}, request {result}: {found.text}"
                    return Refusal(NoPlacement(NoPlacementReason.NO_MATCHING_DEVICE, message))
                hint = hints[spec] = found
            out.append(Clause(claim, result, count, hint))
        return tuple(out)

    def _hint(self, spec: ExactRequest) -> str | SelectorFailure | _Unmatched:
        """e.g. "no H100-SXM5-80GB GPU has a free 3g.40gb placement; 2 would after 1g.10gb
        pods finish", for each (model, profile) the request could use that has no room now;
        or, when the request can use no device at all, which filter leaves nothing.

        Per bucket one GPU speaks for its kind, unless a selector reads identity attributes:
        then every GPU is asked (this runs only when a decision has already failed)."""
        identity = self._eligibility.identity_dependent(spec)
        tally = _Tally()
        matched = False
        per_kind: dict[int, DeviceSet] = {}
        tainted = _Tainted()
        for (kind, occupancy, _), members in self._model.buckets.items():
            if identity:
                speakers = [(self._model.gpus[uuid], 1) for _, uuid in members]
            else:
                speakers = [(self._model.gpus[members[0][1]], len(members))]
            for gpu, n in speakers:
                eligible = None if identity else per_kind.get(kind)
                if eligible is None:
                    found = self._eligibility.eligible(spec, gpu)
                    if isinstance(found, SelectorFailure):
                        return found
                    eligible = found
                    if not identity:
                        per_kind[kind] = found
                matched = matched or bool(eligible)
                tally.add(gpu.geometry, self._room(gpu.geometry, occupancy, eligible), n)
                tainted.add(self._eligibility.untolerated(spec, gpu), n)
        if not matched:
            gpus = list(self._model.gpus.values()) if identity else self._kinds()
            return _Unmatched(self._eligibility.first_empty_filter(spec, gpus))
        return "; ".join(t for t in (tally.text(), tainted.text()) if t)

    def _room(
        self, geometry: Geometry, occupancy: Occupancy, eligible: DeviceSet
    ) -> tuple[_ProfileRoom, ...]:
        """Per eligible profile: whether it fits now, else which profile's departure would make
        room. Memoized per (model, occupancy, eligible)."""
        key = (geometry, occupancy, eligible)
        hit = self._rooms.get(key)
        if hit is not None:
            return hit
        out: list[_ProfileRoom] = []
        for pid in sorted({pid for pid, _ in eligible}):
            starts = [s for p, s in eligible if p == pid]
            if any(occupancy_after(geometry, occupancy, pid, s) for s in starts):
                out.append(_ProfileRoom(pid, True, None))
            else:
                out.append(_ProfileRoom(pid, False, _freed_by(geometry, occupancy, pid, starts)))
        return self._rooms.put(key, tuple(out))

    def _kinds(self) -> list[GpuRecord]:
        """One GPU per kind: devices of one kind differ only in identity attributes."""
        seen: dict[int, GpuRecord] = {}
        for (kind, _, _), members in self._model.buckets.items():
            if kind not in seen:
                seen[kind] = self._model.gpus[members[0][1]]
        return list(seen.values())


class _Tally:
    """Per (GPU model, profile): how many GPUs have room now, and how many would once the pods
    of which profiles finish."""

    def __init__(self) -> None:
        self._free: Counter[tuple[str, int]] = Counter()
        self._freed_by: dict[tuple[str, int], set[str]] = {}
        self._would: Counter[tuple[str, int]] = Counter()
        self._models: dict[str, Geometry] = {}

    def add(self, geometry: Geometry, rooms: Sequence[_ProfileRoom], gpus: int) -> None:
        model_key = geometry.model.key
        self._models[model_key] = geometry
        for room in rooms:
            key = (model_key, room.profile_id)
            self._free[key] += gpus if room.fits_now else 0
            if room.freed_by is not None:
                self._freed_by.setdefault(key, set()).add(room.freed_by)
                self._would[key] += gpus

    def text(self) -> str:
        """The (model, profile) pairs without room anywhere, in a fixed order."""
        texts = []
        for (model_key, pid), n in sorted(self._free.items()):
            if n:
                continue
            name = profile_name(self._models[model_key], pid)
            text = f"no {model_key} GPU has a free {name} placement"
            if self._would[(model_key, pid)]:
                names = ", ".join(sorted(self._freed_by[(model_key, pid)]))
                text += f"; {self._would[(model_key, pid)]} would after {names} pods finish"
            texts.append(text)
        return "; ".join(texts)


class _Tainted:
    """How many GPUs hold devices back from the request by taints it does not tolerate, and
    which taints (an admin's DeviceTaintRule, the node's health taint): a GPU taken out of
    service is otherwise counted silently as one without room."""

    def __init__(self) -> None:
        self._gpus = 0
        self._taints: set[DeviceTaint] = set()

    def add(self, taints: frozenset[DeviceTaint], gpus: int) -> None:
        if taints:
            self._gpus += gpus
            self._taints |= taints

    def text(self) -> str:
        if not self._gpus:
            return ""
        return (
            f"{self._gpus} GPU(s) held back by taints the request does not tolerate: "
            f"{taint_list(self._taints)}"
        )


def _freed_by(geometry: Geometry, occupancy: Occupancy, pid: int, starts: list[int]) -> str | None:
    """The first profile (by id) whose instances, all gone, would let ``pid`` fit."""
    if occupancy.blocked:
        return None
    for q in sorted({q for q, _ in occupancy.state.instances}):
        state = occupancy.state
        for inst in [i for i in state.instances if i[0] == q]:
            state = geometry.remove(state, *inst)
        if pid == WHOLE_GPU:
            ok = not state.instances
        else:
            ok = any(geometry.fits(state, pid, s) for s in starts)
        if ok:
            return profile_name(geometry, q)
    return None


def _tail(exhausted: bool) -> str:
    return " (search limit reached on some nodes)" if exhausted else ""


def _nodes(bad_nodes: Mapping[str, NodeMisfit]) -> str:
    """e.g. "1 node(s) insufficient cpu, 1 node(s) node is cordoned"."""
    reasons = Counter(m.reason.value for m in bad_nodes.values())
    return ", ".join(f"{n} node(s) {r}" for r, n in sorted(reasons.items()))


def _render(clauses: Sequence[Clause], *, counted: bool = True) -> str:
    """Clauses with the same hint become one: "ns/c requests a, b need a device each (...)".

    ``counted=False`` leaves the device counts out (merged firstAvailable combinations ask
    different counts of the same request)."""
    groups: dict[str, list[Clause]] = {}
    for c in clauses:
        groups.setdefault(c.hint, []).append(c)
    texts = []
    for hint, members in groups.items():
        text = _who(members)
        if counted:
            text += f" {_need(members)}"
        if hint:
            text += f" ({hint})"
        texts.append(text)
    return "; ".join(texts)


def _who(clauses: Sequence[Clause]) -> str:
    by_claim: dict[ClaimKey, list[str]] = {}
    for c in clauses:
        by_claim.setdefault(c.claim, []).append(c.result)
    return " and ".join(
        f"{claim} request {names[0]}" if len(names) == 1 else f"{claim} requests {', '.join(names)}"
        for claim, names in by_claim.items()
    )


def _need(clauses: Sequence[Clause]) -> str:
    counts = {c.count for c in clauses}
    if len(clauses) == 1:
        n = clauses[0].count
        return "needs a device" if n == 1 else f"needs {n} devices"
    if counts == {1}:
        return "need a device each"
    if len(counts) == 1:
        return f"need {clauses[0].count} devices each"
    return f"need {sum(c.count for c in clauses)} devices"
