"""The MPS control daemons of prepared claims (kubeletplugin.mps runs one; this keeps them).

With MPS sharing, prepare records the daemon's directories (and its pod's name, where daemons
run in pods), starts it on the carved slices, records its pid as soon as it is forked, and
waits until it answers, all before the CDI spec; teardown stops it (quit, then kill or delete
its pod) before it destroys a slice. Start-up keeps a prepared claim's daemon if it answers
(a new plugin adopts the daemons of the one before) and restarts it otherwise; housekeeping
does the same for a daemon that died. A daemon found dead marks the claim's devices unhealthy
(`down_devices`, merged into the kubelet's health stream) until a later check finds it
answering, and posts an Event on the claim. When whether it runs cannot be told (the API does
not answer about its pod), it is left alone: restarting a daemon that may be fine would cut
its clients off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from driver.cdi import SpecEdits
from kubeletplugin.checkpoint import ClaimRecord
from kubeletplugin.claims import ClaimEvents
from kubeletplugin.ledger import Ledger
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.mps import MpsControl, MpsError, commands_for
from kubeletplugin.planning import PlannedDevice
from kubeletplugin.ports import ClaimError

log = logging.getLogger(__name__)


class ClaimDaemons:
    def __init__(
        self,
        ledger: Ledger,
        control: MpsControl | None,
        *,
        node_name: str,
        metrics: PluginMetrics,
        events: ClaimEvents | None,
    ) -> None:
        self._ledger = ledger
        self._control = control
        self._node = node_name
        self._metrics = metrics
        self._events = events
        # claim uid -> (its MPS devices' names, why): daemons found dead, not yet seen answering
        self._down: dict[str, tuple[tuple[str, ...], str]] = {}

    @property
    def available(self) -> bool:
        return self._control is not None and self._control.available

    def container_env(self) -> Mapping[str, str]:
        return self._control.container_env() if self._control is not None else {}

    def start(
        self, plan: Sequence[PlannedDevice], record: ClaimRecord, ctx: Mapping[str, object]
    ) -> ClaimRecord:
        """Record, start and configure the claim's MPS daemon; PREPARE_COMPLETED waits for it."""
        config = next((p.mps for p in plan if p.mps is not None), None)
        if config is None or self._control is None:
            return record
        uuids = [
            d.mig_uuid or d.gpu_uuid for p, d in zip(plan, record.devices, strict=True) if p.mps
        ]
        intent = self._control.intent(record.uid, uuids)
        record = self._ledger.put(replace(record, mps=intent))
        try:
            running = self._control.start(
                intent,
                commands_for(config, len(uuids)),
                launched=lambda d: self._ledger.put(replace(record, mps=d)),
            )
        except MpsError as e:
            raise ClaimError("mps-start-failed", f"starting the MPS control daemon: {e}") from e
        log.info(
            "MPS control daemon started",
            extra={
                **ctx,
                "daemon": self._control.describe(running),
                "devices": uuids,
                "pipeDir": running.pipe_dir,
            },
        )
        return self._ledger.put(replace(record, mps=running))

    def adopt(self, plan: Sequence[PlannedDevice], record: ClaimRecord) -> ClaimRecord:
        """The record of a claim rebuilt after its checkpoint was lost, with the daemon its MPS
        devices have: its directories follow from the claim's UID, and so does its pod where
        daemons run in pods. A child process's pid is not known (the pid file is the tenants'
        to write), so `ensure` tells such a daemon to quit through its pipe and starts it
        again."""
        if self._control is None or not any(p.mps for p in plan):
            return record
        uuids = [
            d.mig_uuid or d.gpu_uuid for p, d in zip(plan, record.devices, strict=True) if p.mps
        ]
        return replace(record, mps=self._control.intent(record.uid, uuids))

    def spec_edits(self, record: ClaimRecord, shared: SpecEdits) -> SpecEdits:
        """The claim's spec-wide edits: the shared ones, plus its daemon's pipe directory."""
        if record.mps is None or self._control is None:
            return shared
        mount = self._control.mount(record.mps)
        kept = tuple(m for m in shared.mounts if m.container_path != mount.container_path)
        return SpecEdits((*kept, mount), shared.hooks)

    def stop(self, record: ClaimRecord, ctx: Mapping[str, object]) -> ClaimRecord:
        """Before any slice of the claim goes: the daemon serves them. Its record stays until it
        is gone."""
        if record.mps is None:
            return record
        if self._control is None:
            raise ClaimError(
                "mps-unavailable",
                "the claim's MPS control daemon cannot be stopped: this plugin has no "
                "nvidia-cuda-mps-control (start it with the same --driver-root)",
            )
        daemon = self._control.describe(record.mps)
        try:
            self._control.stop(record.mps)
        except MpsError as e:
            raise ClaimError(
                "mps-stop-failed",
                f"stopping the MPS control daemon ({daemon}) before its slices go: {e}",
            ) from e
        log.info("MPS control daemon stopped", extra={**ctx, "daemon": daemon})
        return self._ledger.put(replace(record, mps=None))

    def ensure(self, record: ClaimRecord, ctx: Mapping[str, object], why: str) -> None:
        """Keep a prepared claim's daemon if it answers, else start it again and say so: in
        the log, the errors metric, the claim's devices' health and an Event on the claim."""
        if record.mps is None or self._control is None:
            return
        daemon = self._control.describe(record.mps)
        try:
            answering = self._control.answering(record.mps)
        except MpsError as e:
            log.warning(
                "cannot tell whether the MPS control daemon runs; leaving it as it is",
                extra={**ctx, "daemon": daemon, "when": why, "error": str(e)},
            )
            return
        if answering:
            if self._down.pop(record.uid, None) is not None:
                log.info("MPS control daemon answers again", extra={**ctx, "daemon": daemon})
            elif why == "start-up":
                log.info("MPS control daemon adopted", extra={**ctx, "daemon": daemon})
            return
        self._restart(record, ctx, why)

    def _restart(self, record: ClaimRecord, ctx: Mapping[str, object], why: str) -> None:
        """Start the daemon of a prepared claim again with its saved settings, and say so."""
        assert record.mps is not None and self._control is not None
        self._metrics.errors.labels(operation="reconcile", reason="mps-down").inc()
        log.warning(
            "MPS control daemon of a prepared claim is not running; restarting it",
            extra={**ctx, "daemon": self._control.describe(record.mps), "when": why},
        )
        served = set(record.mps.visible_devices)
        names = tuple(d.device_name for d in record.devices if (d.mig_uuid or d.gpu_uuid) in served)
        claim = f"{record.namespace}/{record.name}"
        self._down[record.uid] = (
            names,
            f"MPS control daemon of claim {claim} is down (restarting)",
        )
        fresh = self._control.renewed(record.mps, record.uid)
        try:
            self._control.stop(record.mps, forget=False)  # a wedged one; its settings stay
            running = self._control.start(
                fresh, launched=lambda d: self._ledger.put(replace(record, mps=d))
            )
        except MpsError as e:
            log.error("MPS control daemon could not be restarted", extra={**ctx, "error": str(e)})
            self._down[record.uid] = (
                names,
                f"MPS control daemon of claim {claim} is down (restart failed: {e})",
            )
            self._event(
                record,
                "MPSDaemonDown",
                f"MPS control daemon on node {self._node} was found dead ({why}) and could not "
                f"be restarted: {e}",
            )
            return
        daemon = self._control.describe(running)
        log.warning("MPS control daemon restarted", extra={**ctx, "daemon": daemon})
        self._ledger.put(replace(record, mps=running))
        self._event(
            record,
            "MPSDaemonRestarted",
            f"MPS control daemon on node {self._node} was found dead ({why}) and restarted "
            f"({daemon}); processes that used the old one must reconnect",
        )

    def down_devices(self) -> Mapping[str, str]:
        """Device name -> why, for the devices of claims whose MPS daemon was found dead and has
        not been seen answering since (a claim unprepared meanwhile no longer counts)."""
        claims = self._ledger.checkpoint().claims
        return {
            name: why
            for uid, (names, why) in list(self._down.items())
            if uid in claims
            for name in names
        }

    def _event(self, record: ClaimRecord, reason: str, message: str) -> None:
        """A Warning Event on the claim (`ClaimEvents` logs a failure, never raises)."""
        if self._events is None:
            return
        self._events.event(
            record.namespace,
            record.name,
            record.uid,
            type_="Warning",
            reason=reason,
            message=message,
        )
