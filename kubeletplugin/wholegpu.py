"""Whole-GPU claims: a GPU handed to one claim with MIG mode off.

CUDA cannot use a GPU in MIG mode as one device. On Hopper and later a take records
`restore_mig` on the device and then turns MIG mode off (only when no instance exists: NVML
refuses otherwise); the release turns it back on before it clears the flag, so a crash at any
point leaves a record whose teardown turns it on again. On Ampere the change needs a GPU reset,
so carve never makes it: whole-GPU devices are published only for Ampere GPUs whose MIG mode is
off, and an allocation of one in MIG mode is refused with a message. While a claim holds a GPU
whole, the node publishes no MIG device on it (`held`) and refuses to carve there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace

from driver.nvml.errors import GpuLost, GpuNotPresent
from kubeletplugin.checkpoint import ClaimRecord, DeviceRecord
from kubeletplugin.foreign import WHOLE_GPU
from kubeletplugin.foreignscan import ForeignScanner
from kubeletplugin.ledger import Ledger
from kubeletplugin.planning import PlannedDevice
from kubeletplugin.ports import ClaimError, MigBackend
from kubeletplugin.warmpool import WarmPool
from kubeletplugin.wording import gpu_label

log = logging.getLogger(__name__)


class WholeGpus:
    def __init__(
        self,
        ledger: Ledger,
        backend: MigBackend,
        *,
        warm: WarmPool,
        foreign: ForeignScanner,
        offers_changed: Callable[[], None],
    ) -> None:
        self._ledger = ledger
        self._backend = backend
        self._warm = warm
        self._foreign = foreign
        self._offers_changed = offers_changed

    def holder(self, gpu_uuid: str, uid: str, *, whole_only: bool) -> ClaimRecord | None:
        """Another checkpointed claim with a device on the GPU (a whole-GPU one only, if asked)."""
        for r in self._ledger.checkpoint().claims.values():
            if r.uid != uid and any(
                d.gpu_uuid == gpu_uuid and not (whole_only and d.is_mig) for d in r.devices
            ):
                return r
        return None

    def take(self, p: PlannedDevice, record: ClaimRecord, i: int) -> ClaimRecord:
        """Device `i` is the whole GPU: make sure it is not in MIG mode.

        The intent to restore MIG mode is checkpointed before MIG mode is turned off, so a crash
        at any point leaves a record whose teardown turns it on again (a no-op if it never went
        off)."""
        gpu, device = p.gpu, p.result.device
        with self._ledger.gpu(gpu.uuid):
            other = self.holder(gpu.uuid, record.uid, whole_only=False)
            if other is not None:
                raise ClaimError(
                    "gpu-taken",
                    f"whole-GPU device {device}: {gpu_label(gpu)} is in use by claim "
                    f"{other.namespace}/{other.name}",
                )
            if not self._backend.mig_enabled(gpu.uuid):
                return record  # MIG mode is off already: nothing to change, nothing to restore
            self._warm.reclaim_where(gpu.uuid, None, ctx={"claimUID": record.uid})
            live = self._backend.instances(gpu.uuid)
            if live:
                if self._foreign.note(gpu, live):
                    self._foreign.mark_stuck(gpu.uuid, WHOLE_GPU)
                raise ClaimError(
                    "placement-taken",
                    f"whole-GPU device {device}: {gpu_label(gpu)} has {len(live)} MIG instance(s) "
                    f"(GI {', '.join(str(g.gi_id) for g in live)}); a whole GPU needs MIG mode "
                    "off, which NVML allows only once no instance exists",
                )
            if gpu.mig_toggle_needs_reset:
                raise ClaimError(
                    "mig-mode-on",
                    f"whole-GPU device {device}: {gpu_label(gpu)} is in MIG mode, and on this "
                    "architecture turning MIG mode off needs a GPU reset, which carve does not "
                    "do (it publishes whole-GPU devices only for such GPUs with MIG mode off; "
                    "the node's ResourceSlices were out of date). To use it whole, run "
                    f"`nvidia-smi -i {gpu.uuid} -mig 0` and reset the GPU",
                )
            flagged = replace(record.devices[i], restore_mig=True)
            record = self._ledger.put(record.with_device(i, flagged))
            try:
                self._backend.disable_mig(gpu.uuid)
            except Exception as e:
                raise ClaimError(
                    "mig-disable-failed",
                    f"whole-GPU device {device}: turning MIG mode off on {gpu_label(gpu)} "
                    f"failed: {e}",
                ) from e
            if self._backend.mig_enabled(gpu.uuid):
                raise ClaimError(
                    "mig-disable-failed",
                    f"whole-GPU device {device}: MIG mode on {gpu_label(gpu)} is still on after "
                    "turning it off",
                )
            log.info(
                "MIG mode turned off for a whole-GPU claim",
                extra={"claimUID": record.uid, "gpu": gpu.uuid, "device": device},
            )
        self._offers_changed()
        return record

    def restore(self, d: DeviceRecord, ctx: Mapping[str, object]) -> None:
        """Turn MIG mode back on after a whole-GPU claim (idempotent: on already is fine). A
        GPU that is lost or gone is left to the reset or reboot that brings it back; carve turns
        MIG mode on again the next time it carves there."""
        with self._ledger.gpu(d.gpu_uuid):
            try:
                self._backend.enable_mig(d.gpu_uuid)
            except (GpuLost, GpuNotPresent) as e:
                log.warning(
                    "MIG mode not restored: the GPU is lost or gone",
                    extra={**ctx, "gpu": d.gpu_uuid, "device": d.device_name, "error": str(e)},
                )
                return
            except Exception as e:
                raise ClaimError(
                    "mig-restore-failed",
                    f"turning MIG mode back on on GPU {d.gpu_uuid} after whole-GPU device "
                    f"{d.device_name} failed (retried): {e}",
                ) from e
        log.info(
            "MIG mode turned back on after a whole-GPU claim",
            extra={**ctx, "gpu": d.gpu_uuid, "device": d.device_name},
        )

    def held(self) -> frozenset[str]:
        """UUIDs of the GPUs a checkpointed claim holds whole (in any state): no MIG device on
        them may be offered until the claim is torn down and MIG mode is back."""
        return frozenset(
            d.gpu_uuid
            for r in self._ledger.checkpoint().claims.values()
            for d in r.devices
            if not d.is_mig
        )
