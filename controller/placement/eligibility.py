"""Which published devices a (sub)request may use: DeviceClass and request selectors, capacity.

Selectors are evaluated as kube-scheduler evaluates them: the class's selectors first, then the
request's, each in order, stopping at the first that is false. A selector that cannot be judged
(syntax error, missing attribute, a comparison CEL does not define, a non-boolean result) is an
error for the whole claim, reported with the selector's position, never a silent non-match:
the user must fix the claim or the class, and retrying cannot help.

Selectors that read no identity attribute (``uuid``, ``parentUUID``, ...) see the same facts on
every GPU of a *kind*, so their answers are remembered per kind and shared by thousands of GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controller.claims import ClaimKey, DeviceClass, ExactRequest
from controller.model import GpuRecord, PublishedDevice, withheld_devices_note
from controller.placement.cache import BoundedCache
from controller.placement.records import DeviceSet
from controller.placement.values import NoPlacement, NoPlacementReason
from controller.tolerations import DeviceTaint, blocking
from driver.cel import CelError, CelErrorKind, SelectorEvaluator
from driver.contract import IDENTITY_ATTRIBUTES, Contract

_COMPILE_KINDS = frozenset({CelErrorKind.SYNTAX, CelErrorKind.TOO_LONG})


@dataclass(frozen=True)
class SelectorFailure:
    """A selector that could not be judged, located the way kube-scheduler locates it: by its
    position in the class's list (``device_class`` set) or in the request's list."""

    error: CelError
    index: int
    device_class: str | None = None

    def refusal(self, claim: ClaimKey, result_name: str) -> NoPlacement:
        """e.g. ``claim ns/c, request r: selector #0: CEL runtime error: no such key ...``."""
        error = self.error
        phase = "compile" if error.kind in _COMPILE_KINDS else "runtime"
        detail = (
            error.detail
            if error.kind is CelErrorKind.RUNTIME
            else (f"{error.kind.value}: {error.detail}")
        )
        where = f"class {self.device_class}: " if self.device_class else ""
        return NoPlacement(
            NoPlacementReason.SELECTOR_ERROR,
            f"claim {claim}, request {result_name}: {where}selector #{self.index}: "
            f"CEL {phase} error: {detail}",
            permanent=True,
        )


class Eligibility:
    """Answers "which devices may this request use" per GPU; see the module docstring.

    ``classes`` is read on every call (the planner edits it in place), and the class's
    selectors are part of every cache key, so an edited class is never answered from a stale
    entry.
    """

    def __init__(
        self, classes: Mapping[str, DeviceClass], driver: str, evaluator: SelectorEvaluator
    ) -> None:
        self.classes = classes
        self.driver = driver
        self.evaluator = evaluator
        self._per_kind: BoundedCache[tuple[ExactRequest, tuple[str, ...], int], DeviceSet] = (
            BoundedCache()
        )
        self._reads_identity: BoundedCache[tuple[ExactRequest, tuple[str, ...]], bool] = (
            BoundedCache()
        )

    def selectors(self, spec: ExactRequest) -> tuple[str, ...]:
        """The class's selectors, then the request's: the order they are evaluated in."""
        return self.classes[spec.device_class].selectors + spec.selectors

    def compile_failure(self, spec: ExactRequest) -> SelectorFailure | None:
        """The first selector of the (sub)request that does not compile, checked before any
        search so that a typo is reported even where no GPU exists."""
        for index, expression, owner in self._located(spec):
            compiled = self.evaluator.compile(expression)
            if isinstance(compiled, CelError):
                return SelectorFailure(compiled, index, owner)
        return None

    def identity_dependent(self, spec: ExactRequest) -> bool:
        """Whether a selector may read per-GPU identity (then eligibility is per GPU)."""
        key = (spec, self.selectors(spec))
        hit = self._reads_identity.get(key)
        if hit is not None:
            return hit
        reads = False
        for expression in key[1]:
            compiled = self.evaluator.compile(expression)
            if (
                isinstance(compiled, CelError)
                or compiled.referenced is None
                or compiled.referenced & IDENTITY_ATTRIBUTES
            ):
                reads = True
        return self._reads_identity.put(key, reads)

    def eligible(self, spec: ExactRequest, gpu: GpuRecord) -> DeviceSet | SelectorFailure:
        """(profile id, start) of the GPU's devices the (sub)request may use."""
        if self.identity_dependent(spec):
            return self._eligible_on(spec, gpu)
        # The class's selectors are part of the key: classes change in place.
        key = (spec, self.selectors(spec), gpu.kind)
        hit = self._per_kind.get(key)
        if hit is not None:
            return hit
        # Selectors that read no identity attribute see the same facts on every GPU of the
        # kind, so this GPU's answer is the kind's. Failures are not remembered: they are
        # reported at once, and the claim must change before it is asked again.
        result = self._eligible_on(spec, gpu)
        if isinstance(result, SelectorFailure):
            return result
        return self._per_kind.put(key, result)

    def first_empty_filter(self, spec: ExactRequest, gpus: Iterable[GpuRecord]) -> str:
        """Which filter leaves none of ``gpus``' devices, in words: the class, the capacity
        request, or the first request selector after which nothing is left (e.g. a selector
        comparing a string attribute with a number, which CEL answers with false); followed by
        why some GPUs offer no whole GPU or no MIG slice now, if any does."""
        gpus = list(gpus)
        # Only the kind the class can ask for: the chart's classes say which; a class of the
        # operator's own could be either.
        contract = Contract(self.driver)
        withheld = withheld_devices_note(
            gpus,
            whole=not contract.asks_mig_only(spec.device_class),
            mig=spec.device_class != contract.gpu_class,
        )
        return self._first_empty(spec, gpus) + (f" ({withheld})" if withheld else "")

    def _first_empty(self, spec: ExactRequest, gpus: Iterable[GpuRecord]) -> str:
        cls = spec.device_class
        devices = [
            d
            for g in gpus
            for d in g.inventory.devices
            if d.facts.driver == self.driver and self._passes(self.classes[cls].selectors, d)
        ]
        if not devices:
            return f"no device published in the cluster matches DeviceClass {cls}"
        devices = [d for d in devices if self._has_capacity(spec, d)]
        if not devices:
            return f"no device of DeviceClass {cls} has the requested capacity"
        for index, expression in enumerate(spec.selectors):
            devices = [d for d in devices if self._passes((expression,), d)]
            if not devices:
                if index == 0:
                    return f"selector #0 matches no device of DeviceClass {cls}"
                return f"selectors #0 to #{index} together match no device of DeviceClass {cls}"
        taints = {t for d in devices for t in blocking(d.taints, spec.tolerations)}
        if taints:
            return (
                f"every matching device of DeviceClass {cls} has a taint the request does not "
                f"tolerate ({taint_list(taints)}); {_who_taints(taints)}"
            )
        return f"no device published in the cluster matches DeviceClass {cls}"

    def untolerated(self, spec: ExactRequest, gpu: GpuRecord) -> frozenset[DeviceTaint]:
        """The taints that keep from the (sub)request devices of this GPU it would otherwise
        match; for a refusal's words only (it evaluates selectors on tainted devices)."""
        out: set[DeviceTaint] = set()
        for d in gpu.inventory.devices:
            blocked = blocking(d.taints, spec.tolerations) if d.taints else ()
            if not blocked or d.facts.driver != self.driver or not self._has_capacity(spec, d):
                continue
            if all(
                self.evaluator.matches(expression, d.facts) is True
                for _, expression, _ in self._located(spec)
            ):
                out.update(blocked)
        return frozenset(out)

    def _located(self, spec: ExactRequest) -> Iterable[tuple[int, str, str | None]]:
        """Each selector with its position and owner (the class name, or None for the
        request), in evaluation order."""
        for index, expression in enumerate(self.classes[spec.device_class].selectors):
            yield index, expression, spec.device_class
        for index, expression in enumerate(spec.selectors):
            yield index, expression, None

    def _eligible_on(self, spec: ExactRequest, gpu: GpuRecord) -> DeviceSet | SelectorFailure:
        out = []
        for d in gpu.inventory.devices:
            verdict = self._device_matches(spec, d)
            if isinstance(verdict, SelectorFailure):
                return verdict
            if verdict:
                out.append((d.profile_id, d.start))
        return frozenset(out)

    def _device_matches(
        self, spec: ExactRequest, device: PublishedDevice
    ) -> bool | SelectorFailure:
        if device.facts.driver != self.driver or not self._has_capacity(spec, device):
            return False
        if device.taints and blocking(device.taints, spec.tolerations):
            return False
        for index, expression, owner in self._located(spec):
            result = self.evaluator.matches(expression, device.facts)
            if isinstance(result, CelError):
                return SelectorFailure(result, index, owner)
            if not result:
                return False
        return True

    @staticmethod
    def _has_capacity(spec: ExactRequest, device: PublishedDevice) -> bool:
        for name, minimum in spec.capacity:
            have = next((v for k, v in device.facts.capacity if k == name), None)
            if have is None or have < minimum:
                return False
        return True

    def _passes(self, expressions: tuple[str, ...], device: PublishedDevice) -> bool:
        return self.evaluator.matches_all(expressions, device.facts) is True


def taint_list(taints: Iterable[DeviceTaint], limit: int = 4) -> str:
    """Taints in words, rules' first, e.g. ``example.com/maint:NoSchedule from DeviceTaintRule
    gpu-maint, mig.carve.dev/gpu-unhealthy=xid-79:NoExecute``; at most ``limit`` of them."""
    ordered = sorted({str(t): t for t in taints}.items(), key=lambda kv: (not kv[1].rule, kv[0]))
    names = [text for text, _ in ordered]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _who_taints(taints: Iterable[DeviceTaint]) -> str:
    """Who puts such taints there, so the user knows whom to ask."""
    sources = {bool(t.rule) for t in taints}
    said = []
    if True in sources:
        said.append("a DeviceTaintRule holds devices out of service until an admin deletes it")
    if False in sources:
        said.append("the node marks unhealthy GPUs so")
    return "; ".join(said)
