"""GPU health as carve judges it: which XID and ECC events make a GPU unhealthy, how badly,
which DRA device taint that becomes, and when it is healthy again. Pure: the node agent feeds
it NVML events and probes (kubeletplugin.gpuhealth) and publishes the taints it derives.

Facts carried over from NVIDIA's public XID catalog and drivers (not their code):
- XIDs 13, 31, 43, 45, 68 and 109 are raised by applications (an illegal access, a page fault,
  a preempted or timed-out context): the GPU is fine, so NVIDIA's device plugin ignores them by
  default, and so does carve;
- XIDs whose documented resolution is a GPU reset or a reboot are fatal for every workload on
  the GPU: 48 (double-bit ECC), 62 and 140 (unrecovered internal errors), 64 (row remapping
  failed), 74 (NVLink), 79 (fallen off the bus), 95 (uncontained ECC), 119 and 120 (GSP);
- the driver also says what recovery it needs (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`: none,
  GPU reset, node reboot, drain and reset); anything but none is fatal, and none again after
  the GPU was found needing one means it was reset;
- a double-bit (uncorrected) ECC error is fatal; single-bit ones are corrected by the hardware.

Every other XID degrades the GPU: new work should go elsewhere, running work may stay.

On a GPU in MIG mode NVML says which GPU instance an XID is attributable to (the event's
`gpuInstanceId`; all ones for the whole GPU), as NVIDIA's device plugin reads it to mark one
MIG device unhealthy. A degrading XID of one instance stays with that instance: only its
device is tainted, until the instance is destroyed or the quiet period passes. A fatal XID is
the whole GPU's even when an instance is named, since its fix, a reset, takes every instance.

The default effects are `NoSchedule` for degraded and `NoExecute` for fatal (kube-controller-manager
evicts pods from devices tainted `NoExecute`). A degraded GPU is healthy again after a quiet
period without a new event; a fatal one only once a reset is seen (the recovery action back to
none, or the volatile ECC counter restarted).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum


class HealthConfigError(ValueError):
    """A health setting carve cannot use; the message names the setting and what is allowed."""


class TaintEffect(StrEnum):
    """resource.k8s.io/v1 DeviceTaint effects."""

    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"
    NONE = "None"


class Severity(IntEnum):
    HEALTHY = 0
    DEGRADED = 1
    FATAL = 2


APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
_XID_NAMES: Mapping[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
RECOVERY_ACTIONS: Mapping[int, str] = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover the IMEX domain",
    6: "bus reset",
    7: "system reboot",
}


def parse_effect(text: str, setting: str) -> TaintEffect:
    try:
        return TaintEffect(text)
    except ValueError:
        allowed = ", ".join(e.value for e in TaintEffect)
        raise HealthConfigError(
            f"{setting}: unknown taint effect {text!r}; use one of {allowed}"
        ) from None


def parse_xids(text: str, setting: str) -> frozenset[int]:
    """A comma-separated list of XIDs ("48,79"; "" for none)."""
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) == 0:
            raise HealthConfigError(
                f"{setting}: {part!r} is not an XID (a positive number); give e.g. '48,79'"
            )
        out.add(int(part))
    return frozenset(out)


@dataclass(frozen=True)
class HealthPolicy:
    fatal_xids: frozenset[int] = FATAL_XIDS
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    fatal_effect: TaintEffect = TaintEffect.NO_EXECUTE
    degraded_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    recovery_seconds: float = 300.0  # a degraded GPU without a new event is healthy again

    def __post_init__(self) -> None:
        both = self.fatal_xids & self.ignored_xids
        if both:
            raise HealthConfigError(
                f"XIDs {sorted(both)} are both fatal and ignored; list each in one place only"
            )
        if self.recovery_seconds <= 0:
            raise HealthConfigError(
                f"health recovery time must be positive, not {self.recovery_seconds}"
            )

    def xid(self, xid: int) -> Severity:
        if xid in self.ignored_xids:
            return Severity.HEALTHY
        return Severity.FATAL if xid in self.fatal_xids else Severity.DEGRADED

    def effect(self, severity: Severity) -> TaintEffect | None:
        if severity is Severity.FATAL:
            return self.fatal_effect
        if severity is Severity.DEGRADED:
            return self.degraded_effect
        return None


def describe_xid(xid: int) -> str:
    name = _XID_NAMES.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


@dataclass(frozen=True)
class Condition:
    """Why a GPU is unhealthy now. `value` is the taint value (a label value)."""

    severity: Severity
    value: str
    reason: str
    since: float
    last_event: float
    # the probe readings when the condition began, to recognise a reset
    ecc_uncorrected: int | None = None
    recovery_asked: bool = False


@dataclass(frozen=True)
class Probe:
    """What a poll of one GPU read; None where the GPU does not report it."""

    recovery_action: int | None = None
    ecc_uncorrected: int | None = None


@dataclass
class HealthTracker:
    """Per GPU (by UUID) its current condition; methods return the GPUs whose condition
    changed, so the caller republishes only then."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    conditions: dict[str, Condition] = field(default_factory=dict)
    # (GPU UUID, GPU instance id) -> a degrading XID of that MIG instance
    instance_conditions: dict[tuple[str, int], Condition] = field(default_factory=dict)
    _last_probe: dict[str, Probe] = field(default_factory=dict)
    _instance_identity: dict[tuple[str, int], object] = field(default_factory=dict)

    def xid(self, gpu: str, xid: int, now: float, instance: int | None = None) -> bool:
        severity = self.policy.xid(xid)
        if instance is not None and severity is Severity.DEGRADED:
            return self._raise_instance(gpu, instance, xid, now)
        return self._raise(gpu, severity, f"xid-{xid}", describe_xid(xid), now)

    def _raise_instance(self, gpu: str, instance: int, xid: int, now: float) -> bool:
        key = (gpu, instance)
        current = self.instance_conditions.get(key)
        value = f"xid-{xid}"
        self.instance_conditions[key] = Condition(
            severity=Severity.DEGRADED,
            value=value,
            reason=f"{describe_xid(xid)} in GPU instance {instance}",
            since=current.since if current is not None else now,
            last_event=now,
        )
        return current is None or current.value != value

    def restore_instance(
        self, key: tuple[str, int], condition: Condition, identity: object
    ) -> None:
        """An instance's condition saved by an earlier run, with what identified the instance."""
        self.instance_conditions[key] = condition
        self._instance_identity[key] = identity

    def instances_now(self, gpu: str, live: Mapping[int, object]) -> bool:
        """The GPU instances of `gpu` that exist now (GI id -> anything that tells a re-created
        instance from the old one, e.g. its placement): a condition whose instance is gone, or
        was re-created, ends with it. The first call for an instance records it."""
        changed = False
        for key in [k for k in self.instance_conditions if k[0] == gpu]:
            seen = self._instance_identity.get(key)
            now_is = live.get(key[1])
            if now_is is None or (seen is not None and seen != now_is):
                del self.instance_conditions[key]
                self._instance_identity.pop(key, None)
                changed = True
            else:
                self._instance_identity[key] = now_is
        return changed

    def ecc(self, gpu: str, *, uncorrected: bool, now: float) -> bool:
        if not uncorrected:
            return False  # corrected by the hardware
        return self._raise(gpu, Severity.FATAL, "ecc-uncorrected", "uncorrected ECC error", now)

    def lost(self, gpu: str, now: float) -> bool:
        """The GPU answers GPU_IS_LOST (fallen off the bus, with or without an XID 79 first):
        fatal, and, as for a recovery action asked for, over at the first probe that reads
        again with no action pending (the reset or reboot that brings a lost GPU back). A
        fatal condition already there (XID 79 names the same loss) keeps its reason."""
        current = self.conditions.get(gpu)
        if current is not None and current.severity is Severity.FATAL:
            self.conditions[gpu] = replace(current, recovery_asked=True, last_event=now)
            return False
        changed = self._raise(
            gpu, Severity.FATAL, "gpu-lost", "the GPU has fallen off the bus (GPU_IS_LOST)", now
        )
        self.conditions[gpu] = replace(self.conditions[gpu], recovery_asked=True)
        return changed

    def probe(self, gpu: str, probe: Probe, now: float) -> bool:
        """A poll's readings: a recovery action asked for is fatal; a reset (the action back to
        none after one was asked, or the volatile uncorrected ECC count restarting) clears a
        fatal condition; a rising uncorrected ECC count is fatal (for GPUs without events)."""
        before = self._last_probe.get(gpu)
        self._last_probe[gpu] = probe
        current = self.conditions.get(gpu)
        action = probe.recovery_action
        if current is not None and current.severity is Severity.FATAL:
            reset = (current.recovery_asked and action == 0) or (
                current.ecc_uncorrected is not None
                and probe.ecc_uncorrected is not None
                and probe.ecc_uncorrected < current.ecc_uncorrected
            )
            if reset:
                del self.conditions[gpu]
                return True
            if action and not current.recovery_asked:
                current = self.conditions[gpu] = replace(current, recovery_asked=True)
            count = probe.ecc_uncorrected
            if count is not None and (
                current.ecc_uncorrected is None or count > current.ecc_uncorrected
            ):
                # the highest count seen while sick: a reset restarts it from zero, below it
                self.conditions[gpu] = replace(current, ecc_uncorrected=count)
            return False
        if action:
            what = RECOVERY_ACTIONS.get(action, f"recovery action {action}")
            return self._raise(
                gpu, Severity.FATAL, "recovery-needed", f"the driver asks for a {what}", now
            )
        if (
            before is not None
            and before.ecc_uncorrected is not None
            and probe.ecc_uncorrected is not None
            and probe.ecc_uncorrected > before.ecc_uncorrected
        ):
            return self._raise(
                gpu, Severity.FATAL, "ecc-uncorrected", "uncorrected ECC errors counted", now
            )
        return False

    def expire(self, now: float) -> list[str]:
        """Degraded GPUs and instances quiet for the recovery time are healthy again; returns
        the GPUs whose condition (or an instance's) ended."""
        quiet = self.policy.recovery_seconds
        done = [
            gpu
            for gpu, c in self.conditions.items()
            if c.severity is Severity.DEGRADED and now - c.last_event >= quiet
        ]
        for gpu in done:
            del self.conditions[gpu]
        for key in [k for k, c in self.instance_conditions.items() if now - c.last_event >= quiet]:
            del self.instance_conditions[key]
            self._instance_identity.pop(key, None)
            done.append(key[0])
        return done

    def _raise(self, gpu: str, severity: Severity, value: str, reason: str, now: float) -> bool:
        if severity is Severity.HEALTHY:
            return False
        current = self.conditions.get(gpu)
        if current is not None and current.severity > severity:
            self.conditions[gpu] = replace(current, last_event=now)
            return False
        probe = self._last_probe.get(gpu)
        new = Condition(
            severity=severity,
            value=value,
            reason=reason,
            since=current.since if current and current.severity == severity else now,
            last_event=now,
            ecc_uncorrected=probe.ecc_uncorrected if probe else None,
            recovery_asked=bool(probe and probe.recovery_action),
        )
        if severity is Severity.FATAL and current is not None and current.severity is severity:
            new = replace(new, recovery_asked=current.recovery_asked, since=current.since)
        self.conditions[gpu] = new
        return current is None or (current.severity, current.value) != (severity, value)

    def taints(self, key: str) -> dict[str, list[dict[str, str]]]:
        """GPU UUID -> the device taints its devices carry (none for an effect of None)."""
        out: dict[str, list[dict[str, str]]] = {}
        for gpu, c in self.conditions.items():
            effect = self.policy.effect(c.severity)
            if effect is None or effect is TaintEffect.NONE:
                continue
            out[gpu] = [{"key": key, "value": c.value, "effect": effect.value}]
        return out

    def instance_taints(self, key: str) -> dict[tuple[str, int], list[dict[str, str]]]:
        """(GPU UUID, GPU instance id) -> the device taints of that instance's device."""
        effect = self.policy.effect(Severity.DEGRADED)
        if effect is None or effect is TaintEffect.NONE:
            return {}
        return {
            k: [{"key": key, "value": c.value, "effect": effect.value}]
            for k, c in self.instance_conditions.items()
        }

    def unhealthy(self) -> dict[str, str]:
        """GPU UUID -> why, for the kubelet's health stream."""
        return {gpu: c.reason for gpu, c in self.conditions.items()}
