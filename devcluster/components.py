"""Command lines of the four control-plane processes (pure: paths and ports in, argv out).

Kept apart from process handling so the flags that decide what carve's tests exercise
(feature gates, controllers, authorization) are in one reviewable place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster.pki import FRONT_PROXY_CN, SERVICE_CLUSTER_IP_RANGE, ClusterPki

# Gates carve depends on that are still beta (or GA but not locked) in 1.37.2, where a
# distribution or a later default could switch them off. They are all on by default in
# 1.37.2 (k8s.io/kubernetes pkg/features/kube_features.go); naming them pins the behaviour
# the regression suite checks. DRAExtendedResource and DRAResourceClaimDeviceStatus are GA
# and locked on in 1.37 (setting them only logs a deprecation warning), so they are left
# out; MutatingAdmissionPolicy is GA since 1.36 and served in admissionregistration/v1.
FEATURE_GATES: Mapping[str, bool] = {
    "DRAPartitionableDevices": True,  # beta: sharedCounters / consumesCounters
    "DRADeviceBindingConditions": True,  # beta: bindingConditions on devices
    "DRAConsumableCapacity": True,  # beta: multi-allocatable devices, capacity requests
    "DRADeviceTaints": True,  # GA, not locked until 1.38: device taints and tolerations
    # GA, not locked until 1.38: DeviceTaintRules served (resource.k8s.io/v1) and applied by
    # kube-scheduler's slice tracker; carve's controller applies them the same way.
    "DRADeviceTaintRules": True,
}

# Controllers a cluster without kubelets needs: claims from templates and their
# reservedFor cleanup, garbage collection of owned objects, namespace/serviceaccount
# lifecycle, node health (our fake nodes heartbeat against it) and the eviction that
# follows taints, the workload controllers a demo uses to create pods, and the disruption
# controller (PodDisruptionBudget status, which the Eviction API and carve's preemption read).
CONTROLLERS: tuple[str, ...] = (
    "resourceclaim-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "device-taint-eviction-controller",
    "pod-garbage-collector-controller",
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "disruption-controller",
    "validatingadmissionpolicy-status-controller",
)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Ports:
    """TCP ports on 127.0.0.1, chosen free at start so parallel clusters never collide."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    scheduler: int
    controller_manager: int


@dataclass(frozen=True)
class Layout:
    """Where one cluster keeps its state; deleting ``root`` forgets the cluster."""

    root: Path

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def scheduler_kubeconfig(self) -> Path:
        return self.root / "scheduler.kubeconfig"

    @property
    def controller_manager_kubeconfig(self) -> Path:
        return self.root / "controller-manager.kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"


def feature_gates_flag(gates: Mapping[str, bool] = FEATURE_GATES) -> str:
    return "--feature-gates=" + ",".join(
        f"{name}={str(on).lower()}" for name, on in sorted(gates.items())
    )


def etcd_args(binary: Path, layout: Layout, ports: Ports) -> list[str]:
    client = f"http://{LOOPBACK}:{ports.etcd_client}"
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return [
        str(binary),
        "--name=devcluster",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        # A test cluster's data is disposable; fsync would dominate write latency on CI disks.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_args(binary: Path, layout: Layout, ports: Ports, pki: ClusterPki) -> list[str]:
    return [
        str(binary),
        f"--etcd-servers=http://{LOOPBACK}:{ports.etcd_client}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        # The endpoint reconciler refuses a loopback advertise address, and with no pods
        # running nothing needs endpoints for the in-cluster "kubernetes" Service.
        "--endpoint-reconciler-type=none",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=Node,RBAC",
        f"--requestheader-client-ca-file={pki.ca.cert}",
        f"--requestheader-allowed-names={FRONT_PROXY_CN}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
        f"--proxy-client-key-file={pki.front_proxy_client.key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.service_account_pub}",
        f"--service-account-signing-key-file={pki.service_account_key}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        # Real nodes (realnode/) register names that no DNS resolves; reach kubelets (logs,
        # exec) by the InternalIP each one reports.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        # No kube-proxy routes Service IPs here: reach a webhook Service (Kueue's, in the Kueue
        # suite) through its EndpointSlice, as the aggregator does for API services.
        "--enable-aggregator-routing=true",
        feature_gates_flag(),
        # Events and logs are read by humans after a failure, not by the tests.
        "--event-ttl=30m",
        "--v=1",
    ]


def _client_rate(qps: float | None) -> list[str]:
    """The client-side rate limit of kube-scheduler and kube-controller-manager, when raised.

    Their defaults (50 and 20 requests per second; bursts 100 and 30) suit small clusters; a
    scale benchmark at these defaults measures them, not carve: generating one pod's claim
    from its template takes kube-controller-manager two requests, so its 20 per second cap
    arrivals near 10 pods per second. Providers raise both for large clusters (to 100-200)."""
    if qps is None:
        return []
    return [f"--kube-api-qps={qps:g}", f"--kube-api-burst={int(2 * qps)}"]


def scheduler_config(
    layout: Layout,
    profiles: Sequence[Mapping[str, Any]],
    client_qps: float | None = None,
    *,
    leader_elect: bool = True,
) -> dict[str, Any]:
    """A KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1) with these `profiles`,
    for a kube-scheduler started with `--config` (`scheduler_args`).

    With `--config`, kube-scheduler ignores its deprecated flags (`--kubeconfig`,
    `--kube-api-qps`, `--kube-api-burst`; cmd/kube-scheduler/app/options, `ApplyTo`), so the
    connection and its rate limit are set here instead. A profile left without `plugins` or
    `pluginConfig` is kube-scheduler's default. A second scheduler beside the cluster's own
    runs without leader election (`leader_elect=False`): the bootstrap RBAC of
    system:kube-scheduler renews only the Lease named kube-scheduler."""
    connection: dict[str, Any] = {"kubeconfig": str(layout.scheduler_kubeconfig)}
    if client_qps is not None:
        connection.update(qps=client_qps, burst=int(2 * client_qps))
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": connection,
        "leaderElection": {"leaderElect": leader_elect},
        "profiles": [dict(p) for p in profiles],
    }


def scheduler_args(
    binary: Path,
    layout: Layout,
    ports: Ports,
    client_qps: float | None = None,
    config: Path | None = None,
) -> list[str]:
    """`config`: a KubeSchedulerConfiguration file (`scheduler_config`) instead of flags;
    `ports.scheduler` is where it serves /metrics and /healthz either way."""
    kubeconfig = layout.scheduler_kubeconfig
    connection = (
        [f"--config={config}"]
        if config is not None
        else [
            f"--kubeconfig={kubeconfig}",
            # Leader election gives readiness a visible signal: the Lease
            # kube-system/kube-scheduler.
            "--leader-elect=true",
            *_client_rate(client_qps),
        ]
    )
    return [
        str(binary),
        *connection,
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.scheduler}",
        feature_gates_flag(),
        "--v=2",
    ]


def controller_manager_args(
    binary: Path, layout: Layout, ports: Ports, pki: ClusterPki, client_qps: float | None = None
) -> list[str]:
    kubeconfig = layout.controller_manager_kubeconfig
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.controller_manager}",
        "--leader-elect=true",
        "--controllers=" + ",".join(CONTROLLERS),
        # Each controller acts as its own service account, so the bootstrap RBAC roles
        # (e.g. system:controller:resourceclaim-controller) are what the tests exercise.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.service_account_key}",
        f"--root-ca-file={pki.ca.cert}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        *_client_rate(client_qps),
        feature_gates_flag(),
        "--v=2",
    ]
