"""The configuration files of one real node: kubelet, containerd and CNI (pure: layout in,
documents out).

Kept in one reviewable place because every setting here decides what carve's real-node tests
exercise. The values that differ from a stock node are there because several nodes share one
machine (own paths, ports, cgroup subtree, bridge) or because this machine has cgroup v1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devcluster.components import FEATURE_GATES, LOOPBACK
from realnode.layout import NodeLayout

# Pods are short-lived in tests: pod sandboxes and containers must go quickly.
_SYNC = "2s"


def kubelet_config(
    layout: NodeLayout, feature_gates: Mapping[str, bool] = FEATURE_GATES
) -> dict[str, Any]:
    """A KubeletConfiguration for one node of many on this machine."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": layout.node_ip,
        "port": layout.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": LOOPBACK,
        "healthzPort": layout.kubelet_healthz_port,
        # The apiserver reaches the kubelet (logs, exec) without a client certificate here;
        # a test machine has nothing else on loopback to keep out.
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup_root,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        # cgroups are v1 on this machine type; kubelet 1.37 refuses v1 unless told.
        "failCgroupV1": False,
        "failSwapOn": False,
        "podLogsDir": str(layout.pod_logs_dir),
        "staticPodPath": "",
        "registerNode": True,
        "nodeStatusUpdateFrequency": "5s",
        "nodeStatusReportFrequency": "30s",
        "syncFrequency": "10s",
        "fileCheckFrequency": _SYNC,
        "runtimeRequestTimeout": "2m",
        # Nodes share one disk, which may be fuller than a real node's; pressure evictions
        # would make test pods disappear for reasons that have nothing to do with carve.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "imageMinimumGCAge": "87600h",
        "serializeImagePulls": False,
        "protectKernelDefaults": False,
        # root here lacks CAP_SYS_RESOURCE: the kubelet could not lower its own score to -999.
        "oomScoreAdj": 0,
        "makeIPTablesUtilChains": False,
        "resolvConf": "/etc/resolv.conf",
        "maxPods": 110,
        "featureGates": dict(feature_gates),
        "shutdownGracePeriod": "0s",
        "logging": {"format": "text", "verbosity": 2},
    }


def kubelet_args(kubelet: Path, layout: NodeLayout, labels: Mapping[str, str]) -> list[str]:
    """The command line: only what KubeletConfiguration cannot say."""
    argv = [
        str(kubelet),
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={layout.kubelet_kubeconfig}",
        f"--root-dir={layout.kubelet_root}",
        f"--hostname-override={layout.name}",
        f"--node-ip={layout.node_ip}",
        f"--cert-dir={layout.kubelet_root / 'pki'}",
    ]
    if labels:
        argv.append("--node-labels=" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
    return argv


def cni_conflist(layout: NodeLayout) -> dict[str, Any]:
    """A bridge network of the node's own: its bridge, its subnet, its IPAM state."""
    return {
        "cniVersion": "1.0.0",
        "name": f"carve-{layout.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": layout.bridge,
                "isGateway": True,
                # No masquerade: pods here talk to loopback and each other, and this machine
                # has no iptables.
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": layout.pod_subnet}]],
                    "dataDir": str(layout.cni_ipam_dir),
                },
            },
            {"type": "loopback"},
        ],
    }


def containerd_config(
    layout: NodeLayout,
    *,
    pause_image: str,
    runc: Path,
    cni_bin_dirs: Sequence[Path],
) -> str:
    """containerd 2.x (config version 3) for one node: its own root, state and socket, CDI
    from the node's CDI directory, CNI from the node's own conflist."""
    q = _toml_string
    bins = ", ".join(q(str(d)) for d in cni_bin_dirs)
    return f"""\
# Generated by realnode.configs for node {layout.name}; hack/node/containerd-config.example.toml
# explains each setting.
version = 4
root = {q(str(layout.containerd_root))}
state = {q(str(layout.containerd_state))}
# Host-wide plugins that would clash between nodes (or are not needed here).
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
]

# Version 4 ignores top-level [grpc]/[ttrpc] without a word: the sockets live here.
[plugins.'io.containerd.server.v1.grpc']
  address = {q(str(layout.containerd_socket))}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {q(str(layout.containerd_socket) + ".ttrpc")}

[debug]
  level = "info"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {q(pause_image)}

# CDI is always on in containerd 2.x; only the spec directories are configurable.
[plugins.'io.containerd.cri.v1.runtime']
  cdi_spec_dirs = [{q(str(layout.cdi_dir))}]
  # root here lacks CAP_SYS_RESOURCE: a sandbox's oom_score_adj of -998 would fail runc.
  restrict_oom_score_adj = true
  # Pod network namespaces under the node's state, not the host-wide /var/run/netns.
  netns_mounts_under_state_dir = true

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = {q(str(runc))}
  SystemdCgroup = false
  # runc's own state per node (the default /run/containerd/runc is shared by every node).
  Root = {q(str(layout.containerd_state / "runc"))}

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [{bins}]
  conf_dir = {q(str(layout.cni_conf_dir))}
  max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = {q(LOOPBACK)}
  stream_server_port = "0"
"""


def _toml_string(text: str) -> str:
    if any(c in text for c in '"\\\n'):
        raise ValueError(f"path {text!r} cannot be written into containerd's config")
    return f'"{text}"'
