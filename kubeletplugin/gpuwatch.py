"""The node's GPUs that cannot be used now, and what carve tells about them.

Every way a GPU becomes unusable goes through here: it fell off the bus (GPU_IS_LOST), an NVML
call on it overran its deadline (*unresponsive*, driver.nvml.deadline), or NVML answered any
other error while it was enumerated (*failing*). The backend knows which GPUs are out
(`NvmlBackend.unusable`); this part enumerates them again every few seconds, and on each change
says so once: a Node event, the gauges, the taints of an unresponsive GPU's devices, and the
`gpus` line of /readyz. A GPU that answers again is handed back to the agent's parts
(`on_back`), which publish it and finish what it interrupted.

An unresponsive GPU's devices carry `<driver>/gpu-unresponsive=nvml-timeout:NoSchedule`, and a
failing one's (published before it failed) `<driver>/gpu-unresponsive=nvml-error:NoSchedule`,
so neither carve's controller nor kube-scheduler allocates there while NVML cannot be used on
it; a device whose claim's prepare or unprepare is stuck there gets `NoExecute` instead, so
that kube-controller-manager evicts its pod and the workload is placed elsewhere, as for an
XID. A lost GPU is tainted by the health monitor (kubeletplugin.gpuhealth), which owns its
reset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from driver.naming import DevicePlace
from driver.nvml.backend import NvmlBackend
from driver.nvml.types import Unusable
from kubeletplugin.checkpoint import Checkpoint, ClaimState
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.nodeevents import NodeEvents

log = logging.getLogger(__name__)

UNRESPONSIVE_TAINT_VALUE = "nvml-timeout"
FAILING_TAINT_VALUE = "nvml-error"
# The kinds of unusable GPU this part taints, and the value that says which.
_TAINT_VALUES = {"unresponsive": UNRESPONSIVE_TAINT_VALUE, "failing": FAILING_TAINT_VALUE}

_EVENT_REASONS = {"lost": "GpuLost", "unresponsive": "GpuUnresponsive", "failing": "GpuFailing"}


@dataclass(frozen=True)
class _Told:
    kind: str
    call: str | None  # for an unresponsive GPU: the call that hangs


class GpuWatch:
    """Enumerates the GPUs again (`check`) and tells each change in what is usable once."""

    def __init__(
        self,
        backend: NvmlBackend,
        events: NodeEvents,
        metrics: PluginMetrics,
        *,
        taint_key: str,
        on_back: Callable[[], None],
        on_change: Callable[[], None],
    ) -> None:
        self._backend = backend
        self._events = events
        self._metrics = metrics
        self._taint_key = taint_key
        self._on_back = on_back
        self._on_change = on_change
        self._told: dict[int, _Told] = {}
        self._lock = threading.Lock()
        self.due = threading.Event()  # set when a GPU hangs or answers: check at once
        backend.on_responsiveness_change(self.due.set)

    def check(self) -> None:
        self.due.clear()
        try:
            self._backend.gpus()
        except Exception as e:
            log.warning("listing GPUs failed", extra={"error": str(e)})
            return
        now = self._backend.unusable()
        hung = self._backend.hung()
        with self._lock:
            before, self._told = (
                self._told,
                {i: _Told(u.kind, hung[i].call if i in hung else None) for i, u in now.items()},
            )
        for index, u in sorted(now.items()):
            told = self._told[index]
            self._metrics.lost_gpus.labels(gpu=str(index)).set(1 if u.kind == "lost" else 0)
            self._metrics.unresponsive_gpus.labels(gpu=str(index)).set(
                1 if u.kind == "unresponsive" else 0
            )
            if before.get(index) == told:
                continue
            if u.kind == "unresponsive":
                self._metrics.nvml_timeouts.labels(gpu=str(index)).inc()
            self._tell(index, u)
        back = sorted(set(before) - set(now))
        for index in back:
            self._metrics.lost_gpus.labels(gpu=str(index)).set(0)
            self._metrics.unresponsive_gpus.labels(gpu=str(index)).set(0)
            self._events.event(
                type_="Normal",
                reason="GpuBack",
                message=f"GPU index {index} answers NVML again; carve uses it again",
            )
        if back:
            self._on_back()
        if back or before != self._told:
            self._on_change()

    def _tell(self, index: int, u: Unusable) -> None:
        if u.kind == "lost":
            message = (
                f"GPU index {index} answers NVML_ERROR_GPU_IS_LOST ({u.why}): carve isolates it "
                "(its devices are tainted NoExecute, or withdrawn if it was lost before the "
                "plugin started; claims on it are released) and the other GPUs keep working. "
                "Reset the GPU or reboot the node"
            )
        elif u.kind == "unresponsive":
            message = (
                f"GPU index {index}: {u.why}. Its devices are tainted {self._taint_key}="
                f"{UNRESPONSIVE_TAINT_VALUE}:NoSchedule (NoExecute where a claim is stuck on "
                "it), prepares and releases on it fail at once, and the node's other GPUs keep "
                "working; carve uses it again when the call returns"
            )
        else:
            message = (
                f"GPU index {index} cannot be read ({u.why}): carve leaves it out (its devices "
                f"are tainted {self._taint_key}={FAILING_TAINT_VALUE}:NoSchedule, or not "
                "published if the plugin never read it; no claim is prepared on it) and the "
                "node's other GPUs keep working; it is tried again every few seconds. Check it "
                "with nvidia-smi and dmesg"
            )
        log.warning("GPU unusable", extra={"gpuIndex": index, "kind": u.kind, "why": u.why})
        self._events.event(type_="Warning", reason=_EVENT_REASONS[u.kind], message=message)

    def unusable(self) -> Mapping[int, Unusable]:
        return self._backend.unusable()

    def taints(self) -> Mapping[str, tuple[Mapping[str, str], ...]]:
        """GPU UUID -> the taints every device of an unresponsive or failing GPU carries."""
        return {
            u.uuid: (self._taint(u.kind, "NoSchedule"),)
            for u in self._backend.unusable().values()
            if u.kind in _TAINT_VALUES and u.uuid is not None
        }

    def _taint(self, kind: str, effect: str) -> Mapping[str, str]:
        return {"key": self._taint_key, "value": _TAINT_VALUES[kind], "effect": effect}

    def stuck_device_taints(
        self, checkpoint: Checkpoint
    ) -> Mapping[str, Mapping[DevicePlace, tuple[Mapping[str, str], ...]]]:
        """GPU UUID -> (profile id, placement start) -> NoExecute, for the MIG devices of
        claims whose prepare or unprepare is unfinished on an unresponsive or failing GPU."""
        kinds = {
            u.uuid: u.kind for u in self._backend.unusable().values() if u.kind in _TAINT_VALUES
        }
        out: dict[str, dict[DevicePlace, tuple[Mapping[str, str], ...]]] = {}
        for record in checkpoint.claims.values():
            if record.state is ClaimState.PREPARE_COMPLETED:
                continue
            for d in record.devices:
                if (
                    d.gpu_uuid in kinds
                    and d.profile_id is not None
                    and d.placement_start is not None
                ):
                    taint = self._taint(kinds[d.gpu_uuid], "NoExecute")
                    out.setdefault(d.gpu_uuid, {})[(d.profile_id, d.placement_start)] = (taint,)
        return out

    def summary(self) -> str:
        """One line per unusable GPU, for /readyz and the logs."""
        return "; ".join(
            f"GPU index {i} is {u.kind} ({u.why})" for i, u in sorted(self.unusable().items())
        )
