"""The CDI devices of a claim: what the container runtime hands each of its containers.

The kubelet hands a container the CDI devices of the requests it names
(`resources.claims[].request`), all of them when it names none. One environment variable cannot
be assembled from several CDI devices (the last one applied wins), so each device names the
devices of its own request: exact for a container that uses one request, the count of a request
included. Device nodes are exact in every case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.cdi import CdiDevice, DeviceNode, mig_device_nodes, whole_gpu_device_nodes
from kubeletplugin.checkpoint import DeviceRecord
from kubeletplugin.planning import PlannedDevice
from kubeletplugin.ports import MigBackend


@dataclass(frozen=True)
class NodeDevices:
    """What every device of this node gets besides its own nodes."""

    common_nodes: tuple[DeviceNode, ...] = ()  # e.g. /dev/nvidia-uvm, whose major is dynamic
    dev_root: Path = Path("/")  # where the device nodes are on the host


def cdi_devices(
    plan: Sequence[PlannedDevice],
    records: Sequence[DeviceRecord],
    backend: MigBackend,
    node: NodeDevices,
    mps_env: Mapping[str, str] | None = None,
) -> list[CdiDevice]:
    """One CDI device per allocated device (`mps_env`: the claim's MPS daemon's variables, for
    the devices that asked for MPS)."""
    by_request: dict[str, list[str]] = {}
    for p, r in zip(plan, records, strict=True):
        by_request.setdefault(p.result.request, []).append(r.mig_uuid or r.gpu_uuid)
    out: list[CdiDevice] = []
    for p, r in zip(plan, records, strict=True):
        env = {**p.env, "NVIDIA_VISIBLE_DEVICES": ",".join(by_request[p.result.request])}
        if mps_env is not None and p.mps is not None:
            env.update(mps_env)
        if r.is_mig:
            assert r.gi_id is not None and r.ci_id is not None
            gi_minor, ci_minor = backend.cap_minors(r.gpu_minor, r.gi_id, r.ci_id)
            nodes = mig_device_nodes(
                gpu_minor=r.gpu_minor,
                caps_major=backend.caps_major(),
                gi_cap_minor=gi_minor,
                ci_cap_minor=ci_minor,
            )
        else:
            nodes = whole_gpu_device_nodes(gpu_minor=r.gpu_minor)
        all_nodes = tuple(n.under(node.dev_root) for n in (*nodes, *node.common_nodes))
        out.append(CdiDevice(r.device_name, all_nodes, env))
    return out
