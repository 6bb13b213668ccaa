"""Which MIG device a prepared claim got: told on the claim and in a metric.

A slice carved on demand gets its UUID only at prepare time, so neither the ResourceSlice nor
the allocation names it, and DCGM-exporter's per-pod metrics cannot attribute it (the gap both
peers leave open). After a successful prepare the node writes, for each device of the claim, a
versioned `data` object into the claim's `status.devices[]` entry (`kubectl describe
resourceclaim` shows it): the MIG UUID, the parent GPU's UUID, the profile, the GPU- and
compute-instance ids and the placement. It is server-side applied by this node's own field
manager, so other writers' entries and fields stay; applying the same content again changes
nothing (retries, restarts, the same claim carved again), and unprepare applies an empty list,
which takes back exactly what this node wrote. The node also exports one info series per
prepared MIG device, `carve_prepared_slice_info`, labelled so that it joins DCGM-exporter's MIG
series on the GPU UUID and GPU-instance id (docs/guide/monitoring.md).

Best effort: a claim's status is for people and monitoring, never a reason to fail a prepare. A
refusal that will not go away by itself (RBAC without the status permissions, or an apiserver
without the device status) is logged once with what to do, counted, and not retried until the
plugin restarts; another failure is retried by housekeeping.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from driver.contract import Contract
from driver.nvml.types import GpuInfo
from kubeletplugin.checkpoint import ClaimRecord, DeviceRecord
from kubeletplugin.claims import ClaimClient
from kubeletplugin.metrics import PluginMetrics
from process.kube.errors import ApiError

log = logging.getLogger(__name__)

DATA_VERSION = "v1alpha1"
DATA_KIND = "PreparedDevice"
# 403: the plugin may not write claim status (RBAC, or the 1.36 per-driver status permission);
# 404 cannot come back for a claim just read; 415/422: the apiserver does not serve it.
_FOR_GOOD = frozenset({403, 415, 422})


def device_data(d: DeviceRecord, gpu: GpuInfo | None, driver: str) -> dict[str, Any]:
    """The `data` of one device's status entry (format `<driver>/v1alpha1`, kind
    PreparedDevice; fields are only ever added to this version)."""
    out: dict[str, Any] = {
        "apiVersion": f"{driver}/{DATA_VERSION}",
        "kind": DATA_KIND,
        "gpuUUID": d.gpu_uuid,
    }
    if not d.is_mig:
        return {**out, "wholeGPU": True}
    profile = gpu.profile(d.profile_id) if gpu is not None and d.profile_id is not None else None
    out.update(
        {
            "migUUID": d.mig_uuid,
            "profile": profile.name if profile else None,
            "profileID": d.profile_id,
            "gpuInstanceID": d.gi_id,
            "computeInstanceID": d.ci_id,
            "placement": {"start": d.placement_start, "size": d.placement_size},
        }
    )
    return {k: v for k, v in out.items() if v is not None}


def status_entries(record: ClaimRecord, gpus: Mapping[int, GpuInfo], driver: str) -> list[Any]:
    """The `status.devices` entries this node owns for a prepared claim."""
    return [
        {
            "driver": driver,
            "pool": d.pool_name,
            "device": d.device_name,
            "data": device_data(d, gpus.get(d.gpu_minor), driver),
        }
        for d in record.devices
    ]


class DeviceReport:
    def __init__(
        self,
        claims: ClaimClient,
        gpus: Mapping[int, GpuInfo],
        metrics: PluginMetrics,
        *,
        driver: str,
        node: str,
    ) -> None:
        self._claims = claims
        self._gpus = gpus
        self._metrics = metrics
        self._driver = driver
        self._manager = Contract(driver).node_field_manager(node)
        self._lock = threading.Lock()
        self._told: set[str] = set()  # claims whose status this process wrote
        self._series: dict[str, list[tuple[str, ...]]] = {}  # claim uid -> info label values
        self._refused = ""  # why the status cannot be written at all ("" while it can)

    def tell(self, record: ClaimRecord, pods: Sequence[str]) -> None:
        """A claim is prepared: its devices on the claim, and its info series."""
        self._set_series(record, pods)
        if self._refused or record.uid in self._told:
            return
        try:
            self._claims.apply_device_status(
                record.namespace,
                record.name,
                record.uid,
                self._manager,
                status_entries(record, self._gpus, self._driver),
            )
        except Exception as e:
            self._failed(record, e)
            return
        self._metrics.device_status.labels(result="ok").inc()
        with self._lock:
            self._told.add(record.uid)

    def known(self, uid: str) -> bool:
        """Whether this process told the claim's devices already (housekeeping tells again
        what a restart or a failed write left untold)."""
        with self._lock:
            return uid in self._told

    def forget(self, record: ClaimRecord) -> None:
        """The claim is being torn down: take back what this node wrote, drop its series."""
        with self._lock:
            self._told.discard(record.uid)
            series = self._series.pop(record.uid, [])
        for labels in series:
            self._metrics.prepared_slice.remove(*labels)
        if self._refused:
            return
        try:
            self._claims.apply_device_status(
                record.namespace, record.name, record.uid, self._manager, []
            )
        except Exception as e:
            self._failed(record, e)

    def _set_series(self, record: ClaimRecord, pods: Sequence[str]) -> None:
        pod = ",".join(p.split("/", 1)[-1] for p in pods)
        rows: list[tuple[str, ...]] = []
        for d in record.devices:
            if not d.is_mig or d.mig_uuid is None:
                continue
            data = device_data(d, self._gpus.get(d.gpu_minor), self._driver)
            labels: tuple[str, ...] = (
                record.namespace,
                pod,
                record.name,
                ",".join(d.request_names),
                d.mig_uuid,
                d.gpu_uuid,
                str(d.gi_id),
                str(data.get("profile", d.profile_id)),
            )
            self._metrics.prepared_slice.labels(*labels).set(1)
            rows.append(labels)
        with self._lock:
            old = self._series.get(record.uid, [])
            self._series[record.uid] = rows
        for gone in old:
            if gone not in rows:
                self._metrics.prepared_slice.remove(*gone)

    def _failed(self, record: ClaimRecord, e: Exception) -> None:
        self._metrics.device_status.labels(result="error").inc()
        claim = f"{record.namespace}/{record.name}"
        if isinstance(e, ApiError) and e.status in _FOR_GOOD:
            self._refused = str(e)
            log.error(
                "cannot write the devices' status on claims; MIG UUIDs will not show in "
                "`kubectl describe resourceclaim`: give the plugin's ClusterRole patch on "
                "resourceclaims/status and associated-node:patch on resourceclaims/driver "
                "(the chart does), on Kubernetes 1.34 or later",
                extra={"claim": claim, "error": str(e)},
            )
            return
        log.warning(
            "could not write the devices' status on a claim; will retry",
            extra={"claim": claim, "error": str(e)},
        )
