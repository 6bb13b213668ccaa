"""Whether a pod may run on a node, judged as kube-scheduler's filters would.

The controller picks the node when it allocates a pod's claims (the claim's nodeSelector pins
the pod there), so a node the scheduler would then refuse leaves the pod stuck with devices
reserved for nothing. This module mirrors the filters that matter for that decision: node
readiness and cordon, taints (NoSchedule, NoExecute) against tolerations, ``nodeSelector``,
required node affinity, and cpu/memory/pod count against allocatable minus what pods on the node
already request. Pure: parsed values in, a verdict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum
from typing import Any

from controller.tolerations import Toleration
from driver.apiviews import NodeView, PodView
from driver.quantity import parse_quantity

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"

# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class Resources:
    """cpu in millicores, memory in bytes, pods as a count."""

    cpu_milli: int = 0
    memory: int = 0
    pods: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli + other.cpu_milli, self.memory + other.memory, self.pods + other.pods
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli - other.cpu_milli, self.memory - other.memory, self.pods - other.pods
        )


NO_RESOURCES = Resources()


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: TaintEffect


@dataclass(frozen=True)
class NodeSelectorRequirement:
    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist | Gt | Lt
    values: tuple[str, ...]


@dataclass(frozen=True)
class NodeSelectorTerm:
    """Requirements ANDed together; the terms of a required affinity are ORed."""

    match_expressions: tuple[NodeSelectorRequirement, ...] = ()
    match_fields: tuple[NodeSelectorRequirement, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    name: str
    allocatable: Resources
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False
    ready: bool = True
    out_of_service: bool = False  # taint node.kubernetes.io/out-of-service: the node is lost

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


@dataclass(frozen=True)
class PodNeeds:
    """What a pod asks of its node, apart from devices."""

    requests: Resources = Resources(pods=1)
    node_selector: tuple[tuple[str, str], ...] = ()
    required_affinity: tuple[NodeSelectorTerm, ...] = ()  # empty: no required affinity
    tolerations: tuple[Toleration, ...] = ()


class MisfitReason(StrEnum):
    UNKNOWN = "no Node object"
    NOT_READY = "node is not Ready"
    OUT_OF_SERVICE = "node is out of service (lost)"
    UNSCHEDULABLE = "node is cordoned"
    TAINT = "untolerated taint"
    NODE_SELECTOR = "node does not match the pod's nodeSelector"
    AFFINITY = "node does not match the pod's required node affinity"
    CPU = "insufficient cpu"
    MEMORY = "insufficient memory"
    PODS = "too many pods"


@dataclass(frozen=True)
class NodeMisfit:
    node: str
    reason: MisfitReason
    detail: str = ""

    @property
    def message(self) -> str:
        text = f"node {self.node}: {self.reason.value}"
        return f"{text} ({self.detail})" if self.detail else text


class PodSpecError(ValueError):
    """A pod or node object the controller cannot interpret; the message names the field."""


# ---------------------------------------------------------------------------------------------
# The check


def check_node(needs: PodNeeds, node: NodeInfo, in_use: Resources) -> NodeMisfit | None:
    """None when the pod fits; otherwise the first reason it does not, in scheduler order.

    An out-of-service node is refused whatever the pod tolerates: carve treats its instances as
    destroyed (`controller.nodehealth.signals`), so nothing new may land there until the taint
    goes.
    """
    if node.out_of_service:
        return NodeMisfit(node.name, MisfitReason.OUT_OF_SERVICE)
    if not node.ready:
        return NodeMisfit(node.name, MisfitReason.NOT_READY)
    if node.unschedulable:
        return NodeMisfit(node.name, MisfitReason.UNSCHEDULABLE)
    for taint in node.taints:
        if taint.effect is TaintEffect.PREFER_NO_SCHEDULE:
            continue
        if not any(t.tolerates(taint) for t in needs.tolerations):
            return NodeMisfit(
                node.name, MisfitReason.TAINT, f"{taint.key}={taint.value}:{taint.effect.value}"
            )
    for key, value in needs.node_selector:
        if node.label(key) != value:
            return NodeMisfit(node.name, MisfitReason.NODE_SELECTOR, f"{key}={value}")
    if needs.required_affinity and not any(
        _term_matches(term, node) for term in needs.required_affinity
    ):
        return NodeMisfit(node.name, MisfitReason.AFFINITY)
    free = node.allocatable - in_use
    want = needs.requests
    if want.cpu_milli > free.cpu_milli:
        return NodeMisfit(
            node.name, MisfitReason.CPU, f"requested {want.cpu_milli}m, free {free.cpu_milli}m"
        )
    if want.memory > free.memory:
        return NodeMisfit(
            node.name, MisfitReason.MEMORY, f"requested {want.memory}, free {free.memory} bytes"
        )
    if want.pods > free.pods:
        return NodeMisfit(
            node.name, MisfitReason.PODS, f"{node.allocatable.pods} allowed, {in_use.pods} placed"
        )
    return None


def _term_matches(term: NodeSelectorTerm, node: NodeInfo) -> bool:
    if not term.match_expressions and not term.match_fields:
        return False  # an empty term matches no objects (core/v1 NodeSelectorTerm)
    fields = {"metadata.name": node.name}
    return all(_requirement_matches(r, node.label(r.key)) for r in term.match_expressions) and all(
        _requirement_matches(r, fields.get(r.key)) for r in term.match_fields
    )


def _requirement_matches(req: NodeSelectorRequirement, value: str | None) -> bool:
    op = req.operator
    if op == "In":
        return value is not None and value in req.values
    if op == "NotIn":
        return value is None or value not in req.values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt"):
        if value is None or len(req.values) != 1:
            return False
        try:
            have, bound = int(value), int(req.values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


# ---------------------------------------------------------------------------------------------
# Parsing Kubernetes objects (camelCase dicts as the API serves them)

_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})


def _quantity(text: object, where: str) -> Decimal:
    if isinstance(text, int | float):
        return Decimal(str(text))
    if not isinstance(text, str):
        raise PodSpecError(f"{where}: expected a quantity string, got {text!r}")
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise PodSpecError(f"{where}: {exc}") from exc


def parse_resources(resources: Mapping[str, Any] | None, where: str) -> Resources:
    """cpu/memory/pods of a ResourceList; other resources are not the controller's concern."""
    resources = resources or {}
    cpu = _quantity(resources.get("cpu", "0"), f"{where}.cpu")
    memory = _quantity(resources.get("memory", "0"), f"{where}.memory")
    pods = _quantity(resources.get("pods", "0"), f"{where}.pods")
    return Resources(
        int((cpu * 1000).to_integral_value(rounding="ROUND_CEILING")), int(memory), int(pods)
    )


def pod_requests(pod_spec: Mapping[str, Any]) -> Resources:
    """Effective requests as the scheduler computes them: the sum over containers, at least the
    largest init container (restartable sidecar init containers add up), plus pod overhead."""
    total = NO_RESOURCES
    for i, c in enumerate(pod_spec.get("containers") or []):
        total += parse_resources(
            (c.get("resources") or {}).get("requests"), f"spec.containers[{i}].resources.requests"
        )
    sidecars = NO_RESOURCES
    init_peak = NO_RESOURCES
    for i, c in enumerate(pod_spec.get("initContainers") or []):
        req = parse_resources(
            (c.get("resources") or {}).get("requests"),
            f"spec.initContainers[{i}].resources.requests",
        )
        if c.get("restartPolicy") == "Always":
            sidecars += req
        else:
            peak = sidecars + req
            init_peak = Resources(
                max(init_peak.cpu_milli, peak.cpu_milli), max(init_peak.memory, peak.memory), 0
            )
    total += sidecars
    total = Resources(
        max(total.cpu_milli, init_peak.cpu_milli), max(total.memory, init_peak.memory), 0
    )
    overhead = parse_resources(pod_spec.get("overhead"), "spec.overhead")
    return Resources(total.cpu_milli + overhead.cpu_milli, total.memory + overhead.memory, 1)


def _requirements(
    items: Sequence[Mapping[str, Any]] | None, where: str
) -> tuple[NodeSelectorRequirement, ...]:
    out = []
    for i, r in enumerate(items or []):
        op = r.get("operator")
        if op not in _OPERATORS:
            raise PodSpecError(
                f"{where}[{i}].operator: {op!r} is not one of {', '.join(sorted(_OPERATORS))}"
            )
        out.append(NodeSelectorRequirement(str(r.get("key", "")), op, tuple(r.get("values") or ())))
    return tuple(out)


def parse_node_selector_terms(
    terms: Sequence[Mapping[str, Any]] | None, where: str
) -> tuple[NodeSelectorTerm, ...]:
    return tuple(
        NodeSelectorTerm(
            _requirements(t.get("matchExpressions"), f"{where}[{i}].matchExpressions"),
            _requirements(t.get("matchFields"), f"{where}[{i}].matchFields"),
        )
        for i, t in enumerate(terms or [])
    )


def parse_pod_needs(pod: Mapping[str, Any]) -> PodNeeds:
    """PodNeeds of a Pod object; PodSpecError names the offending field."""
    view = PodView(pod)
    spec = view.spec
    affinity = (view.affinity.get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = parse_node_selector_terms(
        affinity.get("nodeSelectorTerms"),
        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms",
    )
    tolerations = tuple(
        Toleration(
            str(t.get("key") or ""),
            str(t.get("operator") or "Equal"),
            str(t.get("value") or ""),
            str(t.get("effect") or ""),
        )
        for t in spec.get("tolerations") or []
    )
    return PodNeeds(
        requests=pod_requests(spec),
        node_selector=tuple(sorted((spec.get("nodeSelector") or {}).items())),
        required_affinity=terms,
        tolerations=tolerations,
    )


def parse_node(node: Mapping[str, Any]) -> NodeInfo:
    """NodeInfo of a Node object; PodSpecError names the offending field."""
    view = NodeView(node)
    taints = []
    for i, t in enumerate(view.taints):
        try:
            effect = TaintEffect(str(t.get("effect")))
        except ValueError as exc:
            raise PodSpecError(
                f"spec.taints[{i}].effect: unknown effect {t.get('effect')!r}"
            ) from exc
        taints.append(Taint(str(t.get("key", "")), str(t.get("value") or ""), effect))
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in view.conditions)
    return NodeInfo(
        name=view.name,
        allocatable=parse_resources(view.status.get("allocatable"), "status.allocatable"),
        labels=tuple(sorted(view.labels.items())),
        taints=tuple(taints),
        unschedulable=view.unschedulable,
        ready=ready,
        out_of_service=any(t.key == OUT_OF_SERVICE_TAINT for t in taints),
    )
