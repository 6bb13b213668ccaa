"""Prometheus metrics of the node agent.

Each agent owns its registry (instead of the process-global default) so that several agents can
live in one test process and `/metrics` shows exactly this agent's series.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Carving touches hardware: sub-second normally, seconds with MIG-mode changes or a busy GPU.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.prepare_seconds = Histogram(
            "carve_prepare_duration_seconds",
            "Time to prepare one claim (read, carve, CDI, checkpoint).",
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.unprepare_seconds = Histogram(
            "carve_unprepare_duration_seconds",
            "Time to unprepare one claim (destroy instances, remove CDI spec).",
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.errors = Counter(
            "carve_claim_errors",
            "Claims that failed to prepare or unprepare, by operation and reason.",
            ["operation", "reason"],
            registry=self.registry,
        )
        self.instances = Gauge(
            "carve_mig_instances",
            "MIG instances on this node owned by prepared claims, by profile.",
            ["profile"],
            registry=self.registry,
        )
        self.foreign_instances = Gauge(
            "carve_foreign_mig_instances",
            "MIG instances found on this node that carve did not create.",
            registry=self.registry,
        )
        self.warm_instances = Gauge(
            "carve_warm_mig_instances",
            "MIG instances kept carved after their claim was released (warm slices).",
            registry=self.registry,
        )
        self.warm_outcomes = Counter(
            "carve_warm_slices",
            "Warm-slice outcomes: parked (kept at unprepare), reused (taken over by a claim "
            "instead of carving), reclaimed (destroyed because a placement needed the space), "
            "expired (destroyed unused after the TTL), vanished (found gone).",
            ["outcome"],
            registry=self.registry,
        )
        self._gpu_metrics()
        self.prepared_slice = Gauge(
            "carve_prepared_slice_info",
            "1 per MIG device of a prepared claim: which pod and claim it serves, and which MIG "
            "device it is. Joins DCGM-exporter's MIG series on GPU UUID and GPU-instance id.",
            [
                "namespace",
                "pod",
                "claim",
                "request",
                "mig_uuid",
                "gpu_uuid",
                "gpu_instance_id",
                "profile",
            ],
            registry=self.registry,
        )
        self.device_status = Counter(
            "carve_device_status_writes",
            "Writes of the devices' data into claims' status.devices, by result.",
            ["result"],
            registry=self.registry,
        )
        self.slice_publish = Counter(
            "carve_resourceslice_sync",
            "ResourceSlice synchronisations, by result.",
            ["result"],
            registry=self.registry,
        )

    def _gpu_metrics(self) -> None:
        """The GPUs carve cannot use now (kubeletplugin.gpuwatch)."""
        self.controller_contract_skew = Gauge(
            "carve_plugin_controller_contract_skew",
            "1 while carve-controller's contract version is more than one away from this "
            "plugin's, so it refuses new prepares (kubeletplugin.controllerskew).",
            registry=self.registry,
        )
        self.lost_gpus = Gauge(
            "carve_lost_gpus",
            "GPUs that answer NVML_ERROR_GPU_IS_LOST (fallen off the bus), by NVML index: 1 "
            "while lost. carve isolates them; the node's other GPUs keep working.",
            ["gpu"],
            registry=self.registry,
        )
        self.unresponsive_gpus = Gauge(
            "carve_unresponsive_gpus",
            "GPUs whose NVML call overran --nvml-timeout and has not returned, by NVML index: 1 "
            "while it hangs. Their devices are tainted; the node's other GPUs keep working.",
            ["gpu"],
            registry=self.registry,
        )
        self.nvml_timeouts = Counter(
            "carve_nvml_timeouts_total",
            "Times a GPU became unresponsive (an NVML call on it overran --nvml-timeout).",
            ["gpu"],
            registry=self.registry,
        )

    def set_instances(self, by_profile: Mapping[str, int]) -> None:
        self.instances.clear()
        for profile, count in by_profile.items():
            self.instances.labels(profile=profile).set(count)
