"""A real local Kubernetes v1.37 control plane for carve's tests and demo (dev tooling only).

etcd, kube-apiserver, kube-scheduler and kube-controller-manager are built from the Go module
proxy (hack/k8s/build.sh) and run on 127.0.0.1 with generated certificates, RBAC and the DRA
features carve relies on. Not part of the carve distribution.
"""

from devcluster.binaries import (
    K8S_VERSION,
    Binaries,
    BinariesUnavailableError,
    bin_dir,
    ensure_binaries,
    kubectl_path,
)
from devcluster.cluster import (
    ClusterInfo,
    ClusterStartError,
    LocalCluster,
    read_state,
    stop_cluster_at,
)
from devcluster.components import CONTROLLERS, FEATURE_GATES
from devcluster.nodes import FakeNode, NodeHeartbeater, Taint, create_node, delete_node

__all__ = [
    "CONTROLLERS",
    "FEATURE_GATES",
    "K8S_VERSION",
    "Binaries",
    "BinariesUnavailableError",
    "ClusterInfo",
    "ClusterStartError",
    "FakeNode",
    "LocalCluster",
    "NodeHeartbeater",
    "Taint",
    "bin_dir",
    "create_node",
    "delete_node",
    "ensure_binaries",
    "kubectl_path",
    "read_state",
    "stop_cluster_at",
]
