"""Where one real node keeps everything it owns, and the ports it listens on (pure).

Several real nodes share this machine, so nothing may use the host-wide defaults
(/var/lib/kubelet, /run/containerd, /var/lib/cni, /var/log/pods, port 10250): each node gets
one directory and a node index that picks its ports, its bridge and its pod subnet. Unix
socket paths are limited to 107 bytes, so node directories live under a short root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Bridge names are limited to 15 characters: "carve" + index fits any realistic node count.
_BRIDGE_PREFIX = "carvebr"
# 10.201.<index>.0/24: far from the service range (devcluster.pki) and from Docker's 172.17/16.
_POD_NET_SECOND_OCTET = 201
# The kubelet refuses a loopback node IP, so each node gets 10.200.0.<index>/32 on `lo`: local
# to this machine like loopback, but an address the apiserver can reach the kubelet on.
NODE_IP_PREFIX = "10.200.0."


def node_ip(index: int) -> str:
    return f"{NODE_IP_PREFIX}{index}"


@dataclass(frozen=True)
class NodeLayout:
    """Paths and ports of node number ``index`` (1-based) under ``root``."""

    name: str
    index: int
    root: Path
    kubelet_port: int
    kubelet_healthz_port: int

    # -- containerd ----------------------------------------------------------------------------

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd" / "config.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def containerd_log(self) -> Path:
        return self.root / "containerd.log"

    # -- networking ----------------------------------------------------------------------------

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def node_ip(self) -> str:
        return node_ip(self.index)

    @property
    def bridge(self) -> str:
        return f"{_BRIDGE_PREFIX}{self.index}"

    @property
    def pod_subnet(self) -> str:
        return f"10.{_POD_NET_SECOND_OCTET}.{self.index}.0/24"

    # -- kubelet -------------------------------------------------------------------------------

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.yaml"

    @property
    def kubelet_kubeconfig(self) -> Path:
        return self.root / "kubelet.kubeconfig"

    @property
    def kubelet_log(self) -> Path:
        return self.root / "kubelet.log"

    @property
    def pod_logs_dir(self) -> Path:
        return self.root / "pod-logs"

    @property
    def registry_dir(self) -> Path:
        """The kubelet's plugins_registry: where carve's plugin registers itself."""
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def cgroup_root(self) -> str:
        """This kubelet's own cgroup subtree, so that kubelets on one machine never fight
        over /kubepods."""
        return f"/carve-{self.name}"

    # -- carve's plugin and its simulated GPUs -------------------------------------------------

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def sim_config(self) -> Path:
        return self.root / "sim.yaml"

    @property
    def driver_root(self) -> Path:
        return self.root / "driver"

    @property
    def dev_root(self) -> Path:
        return self.root / "devroot"

    @property
    def plugin_log(self) -> Path:
        return self.root / "plugin.log"

    @property
    def state_file(self) -> Path:
        """What a later ``down`` (or the reaper) needs to clean this node up."""
        return self.root / "node.json"
