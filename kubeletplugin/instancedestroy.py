"""Destroying a claim's MIG instance at teardown: which instance is the claim's, by record or
by intent, and what a GPU that cannot answer means for the claim's release.

Split from kubeletplugin.prepare so that the state machine reads in one file and the rules for
"is this instance still ours" sit next to each other (kubeletplugin.ledger finds instances by
intent; this module decides when to look and what a failure leaves behind).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from driver.catalog import Placement
from driver.nvml.errors import GpuLost, GpuNotPresent, GpuUnresponsive, InstanceMismatch
from kubeletplugin.checkpoint import DeviceRecord
from kubeletplugin.ledger import Ledger, find_own_instance
from kubeletplugin.ports import ClaimError, MigBackend

log = logging.getLogger(__name__)


class InstanceDestroyer:
    """Destroys recorded (or, for inherited claims, intended) MIG instances under the GPU lock."""

    def __init__(self, backend: MigBackend, ledger: Ledger) -> None:
        self._backend = backend
        self._ledger = ledger

    def destroy(
        self, d: DeviceRecord, ctx: Mapping[str, object], *, by_intent: bool, verify: bool = False
    ) -> bool:
        """Destroy the device's instance. Without a recorded id, only a claim inherited from an
        earlier process (`by_intent`) looks for it by profile and placement: that process may
        have crashed between the carve and the save. In this process a failed carve leaves
        nothing behind (the backend rolls back, `Preparer._undo_unsaved_carve` covers the
        save), so an instance found there now is someone else's.

        On a GPU gone from the node, or lost (a reset takes its instances), the claim is
        released: no finalizer waits for a destroy that may never succeed. True for a lost GPU:
        one that answers again without a reset still has the instance (the caller hands it to
        the warm pool to destroy).

        With `verify` (a record of an earlier process: the instance may have been destroyed and
        another created in its place while no agent ran) the instance is destroyed only if NVML
        shows the recorded MIG UUID at the recorded GI id."""
        try:
            self._destroy_locked(d, ctx, by_intent=by_intent, verify=verify)
        except GpuUnresponsive as e:  # kept, with its finalizer, until the call returns
            raise ClaimError("gpu-unresponsive", f"destroying {d.device_name}: {e}") from e
        except GpuNotPresent as e:
            log.warning(
                "the claim's GPU is gone, and its MIG instance with it; releasing",
                extra={**ctx, "gpu": d.gpu_uuid, "device": d.device_name, "error": str(e)},
            )
        except GpuLost as e:
            log.warning(
                "the claim's GPU is lost; releasing the claim, and destroying its MIG instance "
                "if the GPU answers again with it",
                extra={**ctx, "gpu": d.gpu_uuid, "device": d.device_name, "error": str(e)},
            )
            return True
        return False

    def _destroy_locked(
        self, d: DeviceRecord, ctx: Mapping[str, object], *, by_intent: bool, verify: bool
    ) -> None:
        with self._ledger.gpu(d.gpu_uuid):
            assert d.placement_start is not None and d.placement_size is not None
            if d.gi_id is not None:
                gi_id = d.gi_id
                if verify and d.mig_uuid is not None and not self._still_there(d, ctx):
                    return
            else:
                if not by_intent or not self._backend.mig_enabled(d.gpu_uuid):
                    return
                live = self._backend.instances(d.gpu_uuid)
                target = find_own_instance(d, live, self._ledger.checkpoint())
                if target is None:
                    return
                gi_id = target.gi_id
            try:
                # The expectations make NVML-side reuse of the GI id harmless: an instance
                # under that id with another profile or placement is not ours and survives.
                self._backend.destroy(
                    d.gpu_uuid,
                    gi_id,
                    expect_profile_id=d.profile_id,
                    expect_placement=Placement(d.placement_start, d.placement_size),
                )
            except InstanceMismatch:
                log.warning(
                    "recorded MIG instance is gone and its id now names another instance",
                    extra={**ctx, "gpu": d.gpu_uuid, "giID": gi_id, "device": d.device_name},
                )
                return
            except (GpuLost, GpuNotPresent, GpuUnresponsive):
                raise
            except Exception as e:
                raise ClaimError(
                    "destroy-failed",
                    f"destroying MIG instance GI {gi_id} of {d.device_name}: {e}",
                ) from e
            log.info(
                "destroyed MIG instance",
                extra={**ctx, "gpu": d.gpu_uuid, "giID": gi_id, "device": d.device_name},
            )

    def _still_there(self, d: DeviceRecord, ctx: Mapping[str, object]) -> bool:
        """Whether the recorded instance is live, matched by identity (GI id and MIG UUID)."""
        if not self._backend.mig_enabled(d.gpu_uuid):
            return False
        live = self._backend.instances(d.gpu_uuid)
        if find_own_instance(d, live, self._ledger.checkpoint()) is not None:
            return True
        if any(inst.gi_id == d.gi_id for inst in live):
            log.warning(
                "recorded MIG instance is gone and another instance has its id now (created by "
                "someone else): leaving it alone",
                extra={**ctx, "gpu": d.gpu_uuid, "giID": d.gi_id, "migUUID": d.mig_uuid},
            )
        return False
