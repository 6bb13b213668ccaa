"""The controller's seams: what the reconciler needs of its collaborators, as Protocols.

The reconciler decides; the engine behind `Planner` (`controller.planner.EnginePlanner`), the
writer behind `ClaimWriter` (`controller.status.KubeClaimWriter`), the recorder, the metrics
and the preemption hook do the work. Typed against these, the reconciler and the parts it
composes know nothing of MIG geometry or of the API client, and the tests step them with
in-memory fakes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from controller.objects import ClaimAllocation, Kind, Plan, Problem, Unplaceable
from process.kube import Obj


class Planner(Protocol):
    """The placement engine as the reconciler sees it.

    `observe`/`forget` keep the engine's model in step with the API (including the claims that
    this controller has just written). `plan` must treat claims that are already allocated as
    fixed and place the others on the same node, all or nothing.
    """

    def observe(self, kind: Kind, obj: Obj) -> None: ...

    def forget(self, kind: Kind, obj: Obj) -> None: ...

    def plan(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        classes: Mapping[str, Obj],
        told: Unplaceable | None = None,
    ) -> Plan | Unplaceable:
        """`told` is the refusal the pod was given last; a planner may answer with it, as it
        is, when the pod would be refused for the same reason again (and then made no
        decision, so none is timed)."""
        ...

    def check_allocated(self, pod: Obj, claims: Sequence[Obj]) -> Unplaceable | None:
        """Whether a pod whose carve claims are all allocated may be ungated: what its own
        spec asks of them (a container's MPS limits) must fit what they hold."""
        ...

    def fits_after_release(
        self, pod: Obj, claims: Sequence[Obj], released: Collection[str]
    ) -> bool:
        """Whether the pod, refused now, would fit once the allocated claims `released` (store
        keys: their pods ended, their release is under way) are freed: then it waits for a
        release in flight, and carve tells Cluster Autoscaler nothing (`controller.autoscaling`)."""
        ...

    def committed(self, pod: Obj, plan: Plan) -> None:
        """The plan is written: count the pod on `plan.node` until it is bound there."""
        ...

    def withdrawn(self, pod: Obj) -> None:
        """A plan given to `committed` could not be written after all: count the pod nowhere."""
        ...

    def problems(self) -> Mapping[str, Problem]:
        """Contradictions in the model (two claims on one device, ...), by subject: GPUs on
        which the engine builds nothing (`controller.conflicts` tells the user)."""
        ...

    def contract_skew(self) -> Mapping[str, str]:
        """Nodes whose plugin's contract version is out of range: node -> why; their slices
        are not read, so nothing is placed there (`controller.skew` tells the Node)."""
        ...

    def duplicate_gpus(self) -> Mapping[tuple[str, str], str]:
        """GPU UUIDs several nodes publish: (uuid, a node ignored) -> the node it counts on
        (`controller.duplicategpus` tells both)."""
        ...


class PreemptionHook(Protocol):
    """Called for a pod that fits nowhere (`controller.preemption.preemptor.Preemptor`): may evict
    lower-priority pods for it and answers what to tell the pod instead."""

    def unplaceable(
        self,
        pod: Obj,
        claims: Sequence[Obj],
        why: Unplaceable,
        stores: Mapping[Kind, Mapping[str, Obj]],
    ) -> Unplaceable: ...


class Recorder(Protocol):
    """Events for users (`kubectl describe`); `controller.events.KubeRecorder` is the real one."""

    def event(self, obj: Obj, kind: Kind, type_: str, reason: str, message: str) -> None: ...


class Metrics(Protocol):
    """What the controller counts and times; `controller.metrics.ControllerMetrics` is the real
    one (Prometheus)."""

    def observe_allocation(self, seconds: float, profiles: Sequence[str]) -> None: ...

    def observe_decision(self, seconds: float, cpu_seconds: float) -> None: ...

    def set_queue_depth(self, depth: int) -> None: ...

    def count_outcome(self, outcome: str) -> None: ...

    def set_conflicts(self, gpus: int) -> None: ...

    def set_duplicate_gpus(self, gpus: int) -> None: ...

    def set_contract_skew(self, nodes: int) -> None: ...


class ClaimWriter(Protocol):
    """What the reconciler needs from the API; `KubeClaimWriter` is the real one."""

    def read_claim(self, claim: Obj) -> Obj:
        """The claim as the apiserver has it now (a quorum read, not a cache): what settles a
        write whose answer was lost (`controller.settle`)."""
        ...

    def add_finalizer(self, claim: Obj) -> Obj: ...

    def write_allocation(
        self, claim: Obj, allocation: ClaimAllocation, classes: Mapping[str, Obj]
    ) -> Obj: ...

    def clear_allocation(self, claim: Obj) -> Obj: ...

    def remove_finalizer(self, claim: Obj) -> Obj: ...

    def remove_node_finalizer(self, claim: Obj, finalizer: str) -> Obj:
        """Remove a lost node's finalizer on its behalf (`controller.nodehealth`)."""
        ...

    def hand_to_scheduler(self, claim: Obj) -> Obj:
        """Leave an unallocated claim to kube-scheduler (native fallback): our finalizer off,
        the hand-over mark on (`Contract.allocator_annotation`)."""
        ...

    def remove_gate(self, pod: Obj, *, protect: bool = False) -> Obj:
        """Remove carve's gate, after resetting carve's Unschedulable hint; `protect`: mark the
        pod not safe to evict for Cluster Autoscaler (`controller.autoscaling`)."""
        ...

    def pin_and_ungate(self, pod: Obj, node: str) -> Obj:
        """Narrow a gated pod's required node affinity to `node` and remove the gate, in one
        write (a pod asking through extended resources, `controller.extended_resources`)."""
        ...

    def set_pod_condition(self, pod: Obj, status: bool, reason: str, message: str) -> None: ...

    def set_unschedulable(self, pod: Obj, message: str) -> Obj:
        """carve's hint for Cluster Autoscaler on a gated pod (`controller.autoscaling`)."""
        ...

    def reset_unschedulable(self, pod: Obj) -> Obj:
        """The hint turned back into `SchedulingGated` (nothing sent when there is none)."""
        ...
