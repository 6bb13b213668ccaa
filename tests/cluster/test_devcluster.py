"""devcluster's own guarantees: credentials, command lines, fake-node bookkeeping, and that
no component outlives its owner. Only the tests marked ``cluster`` need the binaries."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes import client
from kubernetes.client import ApiClient

from devcluster import components
from devcluster.binaries import Binaries
from devcluster.components import FEATURE_GATES, Layout, Ports
from devcluster.kubeconfig import write_kubeconfig
from devcluster.nodes import (
    FakeNode,
    NodeHeartbeater,
    Taint,
    heartbeat_patch,
    lease_manifest,
    node_manifest,
    node_status,
)
from devcluster.pki import CertificateAuthority, create_cluster_pki
from devcluster.processes import ManagedProcess, ProcessRecord, is_running, stop_recorded
from devcluster.waiting import wait_for

PORTS = Ports(
    etcd_client=2379, etcd_peer=2380, apiserver=6443, scheduler=10259, controller_manager=10257
)


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_component_certificates_carry_the_identities_rbac_expects(tmp_path: Path) -> None:
    pki = create_cluster_pki(tmp_path)
    ca = _load(pki.ca.cert)
    expected = {
        pki.admin.cert: ("carve-admin", ["system:masters"]),
        pki.scheduler.cert: ("system:kube-scheduler", []),
        pki.controller_manager.cert: ("system:kube-controller-manager", []),
    }
    for path, (cn, groups) in expected.items():
        cert = _load(path)
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == cn
        assert [
            a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        ] == groups
    serving = _load(pki.apiserver.cert)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    assert oct(pki.service_account_key.stat().st_mode & 0o777) == "0o600"


def test_users_issued_later_chain_to_the_cluster_ca(tmp_path: Path) -> None:
    pki = create_cluster_pki(tmp_path)
    ca = CertificateAuthority.load(pki.ca)
    files = ca.issue(tmp_path, "alice", common_name="alice", organizations=("team-a", "ops"))
    cert = _load(files.cert)
    cert.verify_directly_issued_by(_load(pki.ca.cert))
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == ["team-a", "ops"]


def test_kubeconfig_embeds_exactly_the_given_credentials(tmp_path: Path) -> None:
    pki = create_cluster_pki(tmp_path)
    path = write_kubeconfig(
        tmp_path / "kc", "https://127.0.0.1:1234", pki.ca.cert, pki.admin, "carve-admin"
    )
    doc = yaml.safe_load(path.read_text())
    cluster = doc["clusters"][0]["cluster"]
    user = doc["users"][0]["user"]
    assert cluster["server"] == "https://127.0.0.1:1234"
    assert base64.b64decode(cluster["certificate-authority-data"]) == pki.ca.cert.read_bytes()
    assert base64.b64decode(user["client-key-data"]) == pki.admin.key.read_bytes()


def test_every_component_gets_the_same_dra_gates(tmp_path: Path) -> None:
    pki = create_cluster_pki(tmp_path / "pki")
    layout = Layout(tmp_path)
    bins = Binaries.in_directory(tmp_path / "bin")
    argvs = {
        "apiserver": components.apiserver_args(bins.kube_apiserver, layout, PORTS, pki),
        "scheduler": components.scheduler_args(bins.kube_scheduler, layout, PORTS),
        "kcm": components.controller_manager_args(bins.kube_controller_manager, layout, PORTS, pki),
    }
    for name, argv in argvs.items():
        gates = [a for a in argv if a.startswith("--feature-gates=")]
        assert len(gates) == 1, name
        enabled = dict(g.split("=") for g in gates[0].removeprefix("--feature-gates=").split(","))
        for gate in (
            "DRAPartitionableDevices",
            "DRADeviceBindingConditions",
            "DRAConsumableCapacity",
            "DRADeviceTaints",
            "DRADeviceTaintRules",
        ):
            assert enabled[gate] == "true", (name, gate)
    controllers = next(a for a in argvs["kcm"] if a.startswith("--controllers="))
    assert {
        "resourceclaim-controller",
        "garbage-collector-controller",
        "node-lifecycle-controller",
    } <= set(controllers.split("=", 1)[1].split(","))
    assert "--authorization-mode=Node,RBAC" in argvs["apiserver"]
    # Nothing listens beyond loopback.
    etcd = components.etcd_args(bins.etcd, layout, PORTS)
    for argv in (*argvs.values(), etcd):
        for arg in argv:
            if "-address=" in arg or "-urls=" in arg:
                assert "127.0.0.1" in arg, arg


def test_client_rate_limits_stay_at_their_defaults_unless_raised(tmp_path: Path) -> None:
    pki = create_cluster_pki(tmp_path / "pki")
    layout = Layout(tmp_path)
    bins = Binaries.in_directory(tmp_path / "bin")

    def argvs(qps: float | None) -> list[list[str]]:
        return [
            components.scheduler_args(bins.kube_scheduler, layout, PORTS, client_qps=qps),
            components.controller_manager_args(
                bins.kube_controller_manager, layout, PORTS, pki, client_qps=qps
            ),
        ]

    for argv in argvs(None):
        assert not [a for a in argv if a.startswith("--kube-api-")]
    for argv in argvs(200):
        assert "--kube-api-qps=200" in argv and "--kube-api-burst=400" in argv


def test_a_scheduler_configuration_carries_what_the_flags_would(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    bins = Binaries.in_directory(tmp_path / "bin")
    binpack = {
        "schedulerName": "binpack",
        "pluginConfig": [
            {
                "name": "NodeResourcesFit",
                "args": {"scoringStrategy": {"type": "MostAllocated"}},
            }
        ],
    }
    config = components.scheduler_config(
        layout, [{"schedulerName": "default-scheduler"}, binpack], client_qps=200
    )
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert config["clientConnection"] == {
        "kubeconfig": str(layout.scheduler_kubeconfig),
        "qps": 200,
        "burst": 400,
    }
    assert config["leaderElection"] == {"leaderElect": True}
    assert [p["schedulerName"] for p in config["profiles"]] == ["default-scheduler", "binpack"]
    assert "qps" not in components.scheduler_config(layout, [])["clientConnection"]
    beside = components.scheduler_config(layout, [binpack], leader_elect=False)
    assert beside["leaderElection"] == {"leaderElect": False}
    argv = components.scheduler_args(
        bins.kube_scheduler, layout, PORTS, client_qps=200, config=tmp_path / "s.yaml"
    )
    assert f"--config={tmp_path / 's.yaml'}" in argv
    # kube-scheduler ignores these beside --config: they must not pretend to apply.
    assert not [a for a in argv if a.startswith(("--kubeconfig=", "--kube-api-", "--leader-"))]
    assert f"--authentication-kubeconfig={layout.scheduler_kubeconfig}" in argv


def test_fake_node_reports_what_a_kubelet_would() -> None:
    node = FakeNode(
        "n1",
        cpu="8",
        memory="32Gi",
        labels={"gpu": "h100"},
        taints=(Taint("carve.test/gpu", "NoSchedule", "yes"),),
        extra_resources={"example.com/widget": "3"},
    )
    manifest = node_manifest(node)
    assert manifest["metadata"]["labels"]["kubernetes.io/hostname"] == "n1"
    assert manifest["metadata"]["labels"]["gpu"] == "h100"
    assert manifest["spec"]["taints"] == [
        {"key": "carve.test/gpu", "value": "yes", "effect": "NoSchedule"}
    ]
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)
    status = node_status(node, now)["status"]
    assert status["allocatable"] == {
        "cpu": "8",
        "memory": "32Gi",
        "pods": "110",
        "example.com/widget": "3",
    }
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["lastHeartbeatTime"]) == ("True", "2026-01-02T03:04:05Z")
    assert (
        heartbeat_patch(now)["status"]["conditions"][0]["lastHeartbeatTime"]
        == "2026-01-02T03:04:05Z"
    )
    lease = lease_manifest("n1", "uid-1", now)
    assert lease["spec"]["renewTime"] == "2026-01-02T03:04:05.678901Z"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


_OWNER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from devcluster.processes import ManagedProcess
    p = ManagedProcess("sleeper", ["/bin/sleep", "300"], Path(sys.argv[1]), tie_to_parent=True)
    print(json.dumps({"pid": p.pid}), flush=True)
    sys.stdin.read()
""")


def _wait_started(record: ProcessRecord, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_running(record):
        assert time.monotonic() < deadline, f"{record.executable} never started"
        time.sleep(0.01)


def _wait_gone(record: ProcessRecord, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while is_running(record):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_component_dies_when_its_owner_is_killed(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path / "log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert owner.stdout is not None
    pid = json.loads(owner.stdout.readline())["pid"]
    record = ProcessRecord("sleeper", pid, "/bin/sleep")
    _wait_started(record)  # the launcher execs the binary a few milliseconds later
    owner.send_signal(signal.SIGKILL)  # no atexit, no finally: only the kernel can help
    owner.wait()
    assert _wait_gone(record), "the component outlived its SIGKILLed owner"


def test_down_only_signals_the_recorded_binary(tmp_path: Path) -> None:
    proc = ManagedProcess("sleeper", ["/bin/sleep", "300"], tmp_path / "log", tie_to_parent=False)
    try:
        _wait_started(proc.record)
        impostor = ProcessRecord("sleeper", proc.pid, "/usr/bin/something-else")
        assert not stop_recorded(impostor)
        assert proc.exit_code() is None
        assert stop_recorded(proc.record)
        assert _wait_gone(proc.record)
    finally:
        proc.stop()


def test_wait_for_returns_the_first_value_its_predicate_accepts() -> None:
    reads = iter([["FailedScheduling"], ["FailedScheduling", "HandedToScheduler"]])
    seen = wait_for("an event", lambda: next(reads), interval=0, until=lambda r: len(r) == 2)
    assert seen == ["FailedScheduling", "HandedToScheduler"]
    assert wait_for("a truthy value", iter([None, 0, "x"]).__next__, interval=0) == "x"


def test_wait_for_fails_with_what_it_saw_last() -> None:
    reads = iter([["Placed"], ["FailedScheduling"]] + [["FailedScheduling", "Scheduled"]] * 1000)
    with pytest.raises(AssertionError) as failure:
        wait_for(
            "the HandedToScheduler event",
            lambda: next(reads),
            timeout=0.05,
            interval=0.01,
            until=lambda r: "HandedToScheduler" in r,
        )
    assert str(failure.value) == (
        "timed out after 0s waiting for the HandedToScheduler event; "
        "last seen: ['FailedScheduling', 'Scheduled']"
    )
    with pytest.raises(AssertionError) as bare:
        wait_for("nothing", lambda: False, timeout=0, interval=0)
    assert str(bare.value) == "timed out after 0s waiting for nothing"


@pytest.mark.cluster
def test_heartbeats_renew_the_node_lease(
    k8s_api: ApiClient, fake_node: object, node_heartbeater: NodeHeartbeater
) -> None:
    assert callable(fake_node)
    name = fake_node()
    coordination = client.CoordinationV1Api(k8s_api)
    before = coordination.read_namespaced_lease(name, "kube-node-lease").spec
    assert before is not None and before.renew_time is not None
    time.sleep(0.01)
    node_heartbeater.beat_once()
    after = coordination.read_namespaced_lease(name, "kube-node-lease").spec
    assert after is not None and after.renew_time is not None
    assert after.renew_time > before.renew_time
    node = client.CoreV1Api(k8s_api).read_node(name)
    assert node.spec is not None
    assert not [t for t in node.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]


_CLUSTER_OWNER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from devcluster.cluster import LocalCluster
    cluster = LocalCluster(Path(sys.argv[1]))
    info = cluster.start()
    print(json.dumps([[p.name, p.pid, p.executable] for p in info.processes]), flush=True)
    sys.stdin.read()
""")


@pytest.mark.cluster
def test_no_component_survives_a_killed_test_session(k8s_cluster: object, tmp_path: Path) -> None:
    """A second, owned cluster in a child process; SIGKILL the child (as a CI timeout
    would) and every control-plane process must go with it."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _CLUSTER_OWNER, str(tmp_path / "c")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert owner.stdout is not None
    records = [ProcessRecord(n, pid, exe) for n, pid, exe in json.loads(owner.stdout.readline())]
    assert [r.name for r in records] == [
        "etcd",
        "kube-apiserver",
        "kube-scheduler",
        "kube-controller-manager",
    ]
    assert all(is_running(r) for r in records)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    survivors = [r.name for r in records if not _wait_gone(r)]
    assert survivors == []


@pytest.mark.cluster
def test_start_retries_on_fresh_ports_when_one_was_taken(
    k8s_cluster: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports are probed free and bound later by the component; if another process takes one
    in between, the start is retried on new ports instead of failing the test run."""
    from devcluster import cluster as cluster_module

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    real_free_ports = cluster_module._free_ports
    handed_out: list[Ports] = []

    def clashing_then_real() -> Ports:
        ports = real_free_ports()
        if not handed_out:
            ports = dataclasses.replace(ports, etcd_client=squatter.getsockname()[1])
        handed_out.append(ports)
        return ports

    monkeypatch.setattr(cluster_module, "_free_ports", clashing_then_real)
    cluster = cluster_module.LocalCluster(tmp_path / "c")
    try:
        info = cluster.start()
        assert len(handed_out) == 2
        assert info.ports == handed_out[1]
        assert all(is_running(p) for p in info.processes)
    finally:
        cluster.stop()
        squatter.close()


@pytest.mark.cluster
def test_the_apis_and_gates_carve_relies_on_are_live(k8s_api: ApiClient) -> None:
    version = client.VersionApi(k8s_api).get_code()
    assert (version.major, version.minor, version.git_version) == ("1", "37", "v1.37.2")
    resources = client.ResourceV1Api(k8s_api).get_api_resources().resources
    assert {
        "deviceclasses",
        "resourceclaims",
        "resourceclaimtemplates",
        "resourceslices",
        "devicetaintrules",
    } <= {r.name for r in resources}
    admission = client.AdmissionregistrationV1Api(k8s_api).get_api_resources().resources
    assert "mutatingadmissionpolicies" in {r.name for r in admission}
    method, url, headers, _, _ = k8s_api.param_serialize("GET", "/metrics")
    response = k8s_api.call_api(method, url, header_params=headers)
    response.read()  # type: ignore[no-untyped-call]
    assert response.status == 200
    assert response.data is not None
    metrics = response.data.decode()
    for gate in FEATURE_GATES:
        assert f'kubernetes_feature_enabled{{name="{gate}",stage="' in metrics, gate
        line = next(
            x
            for x in metrics.splitlines()
            if x.startswith(f'kubernetes_feature_enabled{{name="{gate}",')
        )
        assert line.endswith(" 1"), line
