"""Watches the node's GPUs for XID and ECC errors and keeps their health for the publisher and
the kubelet's health stream (the rules are in driver.gpuhealth).

One thread: it waits on an NVML event set for XID and ECC events of every GPU that supports
them, and every poll interval reads each GPU's recovery action and volatile uncorrected-ECC
count (the only signal for GPUs without events, and what shows a reset). A change of any GPU's
condition calls `on_change`, which republishes the ResourceSlices with or without the GPU's
device taints, saves the conditions (kubeletplugin.healthstate: a restarted plugin starts from
them) and posts an Event on the Node per GPU that turned unhealthy or healthy. NVML errors are
logged and retried; the monitor never stops the plugin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from driver.gpuhealth import Condition, HealthPolicy, HealthTracker, Probe, Severity
from driver.naming import DevicePlace
from driver.nvml.errors import GpuLost
from driver.nvml.healthevents import HealthEvent, HealthEvents
from driver.nvml.types import GpuInstance
from kubeletplugin.healthstate import HealthStateFile
from kubeletplugin.nodeevents import NodeEvents

log = logging.getLogger(__name__)


class HealthBackend(Protocol):
    def health_events(self, gpu_uuids: tuple[str, ...]) -> HealthEvents | None: ...
    def recovery_action(self, gpu_uuid: str) -> int | None: ...
    def uncorrected_ecc_errors(self, gpu_uuid: str) -> int | None: ...
    def instances(self, gpu_uuid: str) -> tuple[GpuInstance, ...]: ...


class HealthMonitor:
    def __init__(
        self,
        backend: HealthBackend,
        gpus: Sequence[str],
        *,
        policy: HealthPolicy,
        taint_key: str,
        poll_seconds: float = 5.0,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        state: HealthStateFile | None = None,
        events: NodeEvents | None = None,
    ) -> None:
        self._backend = backend
        self._gpus = tuple(gpus)
        self._key = taint_key
        self._poll = poll_seconds
        self._on_change = on_change
        self._clock = clock
        self._tracker = HealthTracker(policy)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: HealthEvents | None = None
        self._next_poll = 0.0
        self._state = state
        self._node_events = events
        self._told: dict[str | tuple[str, int], Condition] = {}  # what Node events said last
        self._places: dict[tuple[str, int], DevicePlace] = {}  # (GPU, GI id) -> its device's place

    # -- what others read ------------------------------------------------------------------

    def taints(self) -> Mapping[str, tuple[Mapping[str, str], ...]]:
        """GPU UUID -> the device taints its devices carry now."""
        with self._lock:
            return {g: tuple(t) for g, t in self._tracker.taints(self._key).items()}

    def unhealthy(self) -> Mapping[str, str]:
        """GPU UUID -> why it is unhealthy (for the kubelet's health stream)."""
        with self._lock:
            return self._tracker.unhealthy()

    def device_taints(self) -> Mapping[str, Mapping[DevicePlace, tuple[Mapping[str, str], ...]]]:
        """GPU UUID -> the taints of single MIG devices (an instance's XID), by place."""
        out: dict[str, dict[DevicePlace, tuple[Mapping[str, str], ...]]] = {}
        with self._lock:
            for (gpu, gi), taints in self._tracker.instance_taints(self._key).items():
                place = self._places.get((gpu, gi))
                if place is not None:
                    out.setdefault(gpu, {})[place] = tuple(taints)
        return out

    def unhealthy_devices(self) -> Mapping[str, Mapping[DevicePlace, str]]:
        """GPU UUID -> why single MIG devices are unhealthy, by place (health stream)."""
        out: dict[str, dict[DevicePlace, str]] = {}
        with self._lock:
            for (gpu, gi), c in self._tracker.instance_conditions.items():
                place = self._places.get((gpu, gi))
                if place is not None:
                    out.setdefault(gpu, {})[place] = c.reason
        return out

    # -- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._restore()
        try:
            self._events = self._backend.health_events(self._gpus)
        except Exception as e:
            log.warning("GPU health events unavailable; polling only", extra={"error": str(e)})
        watched = set(self._events.gpus) if self._events else set()
        log.info(
            "GPU health monitor started",
            extra={
                "events": sorted(watched),
                "pollOnly": sorted(set(self._gpus) - watched),
                "pollSeconds": self._poll,
            },
        )
        self.poll()
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._events is not None:
            self._events.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as e:  # never let the thread die
                log.warning("GPU health check failed; retrying", extra={"error": str(e)})
                self._stop.wait(self._poll)

    def step(self) -> None:
        """Wait for one event (or until the next poll is due), then poll if it is."""
        wait = max(0.0, self._next_poll - self._clock())
        if self._events is not None:
            event = self._events.wait(int(wait * 1000))
            if event is not None:
                self.handle(event)
        else:
            self._stop.wait(wait)
        if self._clock() >= self._next_poll:
            self.poll()

    def handle(self, event: HealthEvent) -> None:
        now = self._clock()
        with self._lock:
            if event.kind == "xid" and event.xid is not None:
                changed = self._tracker.xid(event.gpu_uuid, event.xid, now, event.gpu_instance)
            else:
                uncorrected = event.kind == "ecc-uncorrected"
                changed = self._tracker.ecc(event.gpu_uuid, uncorrected=uncorrected, now=now)
        log.warning(
            "GPU health event",
            extra={
                "gpu": event.gpu_uuid,
                "kind": event.kind,
                "xid": event.xid,
                "gpuInstance": event.gpu_instance,
            },
        )
        # Read what the driver asks for now, so that the reset that follows is recognised even
        # if it comes before the next poll; and which instance the event names, before it goes.
        changed = self._probe(event.gpu_uuid, now) or changed
        if event.gpu_instance is not None:
            changed = self._check_instances(event.gpu_uuid) or changed
        if changed:
            self._changed()

    def poll(self) -> None:
        """Read every GPU's recovery action and ECC count; expire quiet degraded GPUs."""
        now = self._clock()
        self._next_poll = now + self._poll
        changed = False
        for gpu in self._gpus:
            changed = self._probe(gpu, now) or changed
        with self._lock:
            with_instances = sorted({gpu for gpu, _ in self._tracker.instance_conditions})
        for gpu in with_instances:
            changed = self._check_instances(gpu) or changed
        with self._lock:
            changed = bool(self._tracker.expire(now)) or changed
        if changed:
            self._changed()

    def _probe(self, gpu: str, now: float) -> bool:
        try:
            probe = Probe(
                recovery_action=self._backend.recovery_action(gpu),
                ecc_uncorrected=self._backend.uncorrected_ecc_errors(gpu),
            )
        except GpuLost:
            with self._lock:
                return self._tracker.lost(gpu, now)
        except Exception as e:
            log.warning("GPU health probe failed", extra={"gpu": gpu, "error": str(e)})
            return False
        with self._lock:
            return self._tracker.probe(gpu, probe, now)

    def _check_instances(self, gpu: str) -> bool:
        """End the conditions of `gpu`'s instances that were destroyed (or re-created)."""
        try:
            live = {
                gi.gi_id: (gi.profile_id, gi.placement.start) for gi in self._backend.instances(gpu)
            }
        except Exception as e:
            log.warning("listing GPU instances failed", extra={"gpu": gpu, "error": str(e)})
            return False
        with self._lock:
            changed = self._tracker.instances_now(gpu, live)
            for key in list(self._places):
                if key[0] == gpu and key not in self._tracker.instance_conditions:
                    del self._places[key]
            for g, gi in self._tracker.instance_conditions:
                if g == gpu and gi in live:
                    self._places[(g, gi)] = live[gi]
        return changed

    def watch(self, gpus: Sequence[str]) -> None:
        """Also watch these GPUs: they answer NVML again after having been lost when the
        monitor started. They are polled (not subscribed to events), starting from the
        conditions saved for them, so that the reset that brought them back is recognised and
        said."""
        new = tuple(g for g in gpus if g not in self._gpus)
        if not new:
            return
        self._gpus = (*self._gpus, *new)
        self._restore(frozenset(new))
        self.poll()

    def _restore(self, only: frozenset[str] | None = None) -> None:
        """Start from the saved conditions of this node's GPUs (see kubeletplugin.healthstate),
        or of `only` those."""
        if self._state is None:
            return
        loaded = self._state.load()
        mine = set(self._gpus if only is None else only)
        saved = {g: c for g, c in loaded.gpus.items() if g in mine}
        instances = {k: c for k, c in loaded.instances.items() if k[0] in mine}
        with self._lock:
            self._tracker.conditions.update(saved)
            for key, condition in instances.items():
                place = loaded.places.get(key)
                if place is not None:
                    self._tracker.restore_instance(key, condition, place)
                    self._places[key] = place
        # An instance destroyed (or re-created) while the plugin was down ends its condition.
        for gpu in sorted({g for g, _ in instances}):
            self._check_instances(gpu)
        if only is None:
            self._told = {}
        self._told.update(saved)
        for key, c in instances.items():
            self._told[key] = c
        if saved or instances:
            log.warning(
                "GPU health restored from the last run",
                extra={"unhealthy": {str(k): c.reason for k, c in self._told.items()}},
            )

    def _changed(self) -> None:
        with self._lock:
            conditions = dict(self._tracker.conditions)
            instances = dict(self._tracker.instance_conditions)
        log.warning(
            "GPU health changed", extra={"unhealthy": {g: c.reason for g, c in conditions.items()}}
        )
        if self._state is not None:
            self._save(conditions, instances)
        try:
            self._on_change()
        except Exception as e:
            log.warning("republishing after a GPU health change failed", extra={"error": str(e)})
        self._tell(conditions, instances)

    def _save(
        self,
        conditions: Mapping[str, Condition],
        instances: Mapping[tuple[str, int], Condition],
    ) -> None:
        """Save what this monitor knows, and keep what was saved for GPUs it does not watch
        (lost when it started): when one comes back, `watch` starts from it."""
        assert self._state is not None
        watched = set(self._gpus)
        try:
            before = self._state.load()
        except Exception:
            before = None
        gpus, more, places = dict(conditions), dict(instances), dict(self._places)
        if before is not None:
            gpus.update({g: c for g, c in before.gpus.items() if g not in watched})
            more.update({k: c for k, c in before.instances.items() if k[0] not in watched})
            places.update({k: p for k, p in before.places.items() if k[0] not in watched})
        try:
            self._state.save(gpus, more, places)
        except OSError as e:
            log.warning("could not save GPU health", extra={"error": str(e)})

    def _tell(
        self,
        conditions: Mapping[str, Condition],
        instances: Mapping[tuple[str, int], Condition],
    ) -> None:
        """One Node event per GPU or instance whose condition (severity, value) changed."""
        if self._node_events is None:
            return
        now: dict[str | tuple[str, int], Condition] = {}
        now.update(conditions)
        for key, c in instances.items():
            now[key] = c
        gpu_taints = self._tracker.taints(self._key)
        gi_taints = self._tracker.instance_taints(self._key)
        for subject in sorted(set(now) | set(self._told), key=str):
            new, old = now.get(subject), self._told.get(subject)
            if (new and (new.severity, new.value)) == (old and (old.severity, old.value)):
                continue
            if isinstance(subject, tuple):
                gpu, gi = subject
                who, what = f"GPU {gpu} instance {gi}", "its device is"
                taint = gi_taints.get(subject)
            else:
                who, what = f"GPU {subject}", "its devices are"
                taint = gpu_taints.get(subject)
            if new is None:
                self._node_events.event(
                    type_="Normal",
                    reason="GpuHealthy",
                    message=f"{who} is healthy again (it was: {old.reason if old else '?'}); "
                    f"{what} no longer tainted",
                )
                continue
            effect = taint[0]["effect"] if taint else "no scheduling effect"
            if new.severity is Severity.FATAL:
                until = "fatal, until the GPU is reset"
            else:
                quiet = f"{self._tracker.policy.recovery_seconds:g}s without a new error"
                until = f"degraded, until {quiet}" + (
                    " or the instance is destroyed" if isinstance(subject, tuple) else ""
                )
            self._node_events.event(
                type_="Warning",
                reason="GpuUnhealthy",
                message=f"GPU {subject[0] if isinstance(subject, tuple) else subject}: "
                f"{new.reason} ({until}); {what} tainted {self._key}={new.value}:{effect}",
            )
        self._told = now
