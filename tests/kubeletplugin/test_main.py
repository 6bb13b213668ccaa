"""carve-kubelet-plugin as a real process: flags, ops endpoints, kubelet protocol, shutdown.

The cluster tests run the plugin against the real kube-apiserver (devcluster): ResourceSlices
are published and accepted, a claim allocated through the status subresource is prepared and
unprepared through the kubelet's gRPC protocol, the node finalizer follows the instance, wiped
slices come back, and --cleanup-on-exit removes them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.waiting import wait_for
from driver import cdi
from driver.naming import mig_device_name
from kubeletplugin.options import parse_options
from kubeletplugin.ports import ClaimRef
from nodesim.kubelet import KubeletSim
from process.flags import UsageError
from tests.support.plugin_process import (
    DRIVER,
    PLUGIN,
    REPO,
    PluginProcess,
    unreachable_kubeconfig,
)


def test_every_flag_has_an_env_equivalent() -> None:
    env = {
        "NODE_NAME": "n1",
        "CARVE_DRIVER_NAME": "x.example.com",
        "CARVE_CDI_ROOT": "/tmp/cdi",
        "CARVE_FOREIGN_INSTANCES": "adopt",
        "CARVE_SIMULATE": "/etc/sim.yaml",
        "CARVE_HTTP_ADDRESS": "127.0.0.1:9",
        "CARVE_RESYNC_PERIOD": "2m",
        "CARVE_CLEANUP_ON_EXIT": "true",
        "CARVE_PLUGINS_DIR": "/p",
    }
    o = parse_options([], env)
    assert (o.node_name, o.driver_name, o.cdi_root) == ("n1", "x.example.com", Path("/tmp/cdi"))
    assert o.foreign_instances == "adopt" and o.simulate == Path("/etc/sim.yaml")
    assert (o.http_address, o.resync_period) == ("127.0.0.1:9", 120.0)
    assert o.cleanup_on_exit and not o.cleanup
    assert o.checkpoint_dir == Path("/p/x.example.com")
    assert o.deprecations == ()
    flags = parse_options(["--node-name", "n2", "--foreign-instances", "refuse-gpu"], env)
    assert flags.node_name == "n2" and flags.foreign_instances == "refuse-gpu"
    assert parse_options([], {**env, "CARVE_NODE_NAME": "n3"}).node_name == "n3"


def test_carve_before_bind_is_off_unless_asked() -> None:
    o = parse_options(["--node-name=n"], {})
    assert (o.binding_conditions, o.carve_failure_cooldown) == (False, 300.0)
    on = parse_options(
        ["--node-name=n", "--binding-conditions"], {"CARVE_CARVE_FAILURE_COOLDOWN": "1m"}
    )
    assert (on.binding_conditions, on.carve_failure_cooldown) == (True, 60.0)


def test_mps_daemons_run_in_pods_only_when_given_an_image_and_a_namespace() -> None:
    o = parse_options(["--node-name=n"], {})
    assert (o.mps_daemon_image, o.mps_daemon_namespace) == (None, None)
    pods = parse_options(
        ["--node-name=n", "--mps-daemon-image=carve:1"],
        {
            "CARVE_MPS_DAEMON_NAMESPACE": "carve-system",
            "CARVE_MPS_DAEMON_IMAGE_PULL_POLICY": "Never",
            "CARVE_MPS_DAEMON_SERVICE_ACCOUNT": "carve-mps-daemon",
        },
    )
    assert (pods.mps_daemon_image, pods.mps_daemon_namespace) == ("carve:1", "carve-system")
    assert pods.mps_daemon_pull_policy == "Never"
    assert pods.mps_daemon_service_account == "carve-mps-daemon"


def test_switches_take_a_bare_flag_or_a_value() -> None:
    assert parse_options(["--node-name=n", "--cleanup"], {}).cleanup
    assert not parse_options(["--node-name=n", "--cleanup=false"], {"CARVE_CLEANUP": "1"}).cleanup


@pytest.mark.parametrize(
    ("argv", "env", "http", "resync", "deprecated"),
    [
        (["--metrics-address=:9", "--resync-seconds=5"], {}, ":9", 5.0, "--metrics-address"),
        ([], {"CARVE_METRICS_ADDRESS": ":9", "CARVE_RESYNC_SECONDS": "5"}, ":9", 5.0, "_SECONDS"),
        (["--resync-seconds=5", "--resync-period=1m"], {}, ":8080", 60.0, "ignored"),
    ],
)
def test_old_spellings_still_work_and_are_reported(
    argv: list[str], env: dict[str, str], http: str, resync: float, deprecated: str
) -> None:
    o = parse_options(["--node-name=n", *argv], env)
    assert (o.http_address, o.resync_period) == (http, resync)
    assert any(deprecated in note and "deprecated" in note for note in o.deprecations)


def test_old_cdi_root_variable_still_works() -> None:
    o = parse_options(["--node-name=n"], {"CDI_ROOT": "/old"})
    assert o.cdi_root == Path("/old")
    assert o.deprecations == ("CDI_ROOT is deprecated: use --cdi-root or CARVE_CDI_ROOT "
                              "(e.g. --cdi-root=/var/run/cdi)",)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "--node-name is required"),
        (["--node-name", "n", "--foreign-instances", "destroy"], {}, "adopt, leave, refuse-gpu"),
        (
            ["--node-name", "n", "--resync-period", "abc"],
            {},
            r"--resync-period='abc': not a duration.*e\.g\. --resync-period=30s",
        ),
        (["--node-name", "n", "--resync-seconds", "soon"], {}, "--resync-seconds='soon'"),
        (["--node-name", "n"], {"CARVE_RESYNC_PERIOD": "x"}, r"CARVE_RESYNC_PERIOD='x' \(--resync"),
        (["--node-name", "n", "--http-address", "nowhere"], {}, "e.g. --http-address="),
        (["--node-name", "n", "--driver-name", "Not_DNS"], {}, "--driver-name='Not_DNS'"),
        (["--node-name", "n", "--log-format", "xml"], {}, "json, text"),
        (["--node-name", "n", "--binding-conditions=sometimes"], {}, "--binding-conditions"),
        (
            ["--node-name", "n", "--carve-failure-cooldown", "a while"],
            {},
            r"--carve-failure-cooldown='a while': not a duration.*e\.g\. --carve-failure",
        ),
        (["--node-name", "n", "--mps-daemon-image", "carve:1"], {}, "--mps-daemon-namespace"),
        (
            ["--node-name", "n", "--mps-daemon-image-pull-policy", "Sometimes"],
            {},
            "IfNotPresent, Always, Never",
        ),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_options(argv, env)


def test_a_bad_value_exits_2_naming_the_flag() -> None:
    out = subprocess.run(
        [PLUGIN, "--node-name=n", "--resync-period=abc"],
        check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith("carve-kubelet-plugin: --resync-period='abc': not a duration")
    assert "e.g. --resync-period=30s" in out.stderr


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_process_without_apiserver_serves_and_fails_claims_cleanly(tmp_path: Path) -> None:
    p = PluginProcess(tmp_path, "node-x", unreachable_kubeconfig(tmp_path / "kc"))
    try:
        plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
        assert _get(p.url("/healthz")) == (200, "ok\n")
        code, body = wait_for(
            "registration to show in /readyz",
            lambda: "\n[+]registration ok\n" in (r := _get(p.url("/readyz")))[1] and r,
        )
        assert code == 503 and "apiserver unreachable" in body, body
        assert "[-]startup start-up is waiting for the apiserver" in body, body
        ref = ClaimRef("default", "c", str(uuid.uuid4()))
        res = plugin.prepare([ref])[ref.uid]
        assert "cannot read the ResourceClaim from the API" in res.error
        assert plugin.unprepare([ref]) == {ref.uid: ""}
        metrics = _get(p.url("/metrics"))[1]
        assert 'carve_claim_errors_total{operation="prepare",reason="api"} 1.0' in metrics
        assert "carve_prepare_duration_seconds_count 1.0" in metrics
    finally:
        rc = p.stop()
    assert rc == 0, p.logs()[-3000:]
    assert not list(p.registry.glob("*.sock"))
    lines = [json.loads(x) for x in p.logs().splitlines() if x.startswith("{")]
    failed = [x for x in lines if x["msg"] == "prepare failed"]
    assert failed and failed[0]["claim"] == "default/c" and failed[0]["reason"] == "api"


def test_a_gpu_hung_at_start_up_leaves_the_others_served_and_sigterm_still_ends_it(
    tmp_path: Path,
) -> None:
    """Issue 45, point 1: a hung MIG-mode query on one GPU used to keep the agent from starting
    at all, and a hung call kept it from honouring SIGTERM."""
    hang = {"op": "DeviceGetMigMode", "action": "hang", "gpu": 0}
    p = PluginProcess(
        tmp_path, "node-h", unreachable_kubeconfig(tmp_path / "kc"), "--nvml-timeout=1s",
        faults=(hang,),
    )  # fmt: skip
    try:
        p.kubelet.wait_for_plugin(DRIVER, timeout=30)
        assert _get(p.url("/healthz")) == (200, "ok\n")
        metrics = wait_for(
            "GPU 0 to be reported unresponsive",
            lambda: (
                'carve_unresponsive_gpus{gpu="0"} 1.0' in (m := _get(p.url("/metrics"))[1]) and m
            ),
        )
        assert 'carve_nvml_timeouts_total{gpu="0"} 1.0' in metrics
    finally:
        started = time.monotonic()
        rc = p.stop()
    assert rc == 0 and time.monotonic() - started < 15, p.logs()[-3000:]
    lines = [json.loads(x) for x in p.logs().splitlines() if x.startswith("{")]
    assert any(x["msg"] == "GPU unusable" and x["kind"] == "unresponsive" for x in lines)


# --- against the real control plane ------------------------------------------------------


@pytest.fixture
def cluster_plugin(
    k8s_cluster: Any, fake_node: Callable[..., str], tmp_path: Path
) -> Iterator[tuple[PluginProcess, str, Any]]:
    node = fake_node()
    p = PluginProcess(tmp_path, node, k8s_cluster.info.kubeconfig, "--cleanup-on-exit")
    try:
        yield p, node, k8s_cluster.api_client()
    finally:
        if p.proc.poll() is None:
            p.stop()


def _slices(api: Any, node: str) -> list[dict[str, Any]]:
    from process.kube.jsonclient import KubeJson

    return KubeJson(api).request(
        "GET",
        "/apis/resource.k8s.io/v1/resourceslices",
        query=[("fieldSelector", f"spec.nodeName={node},spec.driver={DRIVER}")],
    )["items"]


@pytest.mark.cluster
def test_plugin_against_real_apiserver(
    cluster_plugin: tuple[PluginProcess, str, Any], namespace: str
) -> None:
    from process.kube.jsonclient import KubeJson

    p, node, api = cluster_plugin
    kube = KubeJson(api)
    plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)

    # published, split layout (1.37): per GPU one counter slice and one device slice
    slices = wait_for("ResourceSlices", lambda: len(s := _slices(api, node)) >= 4 and s)
    counters = [s for s in slices if s["spec"].get("sharedCounters")]
    devices = [d["name"] for s in slices for d in s["spec"].get("devices") or ()]
    assert len(counters) == 2 and not any(s["spec"].get("devices") for s in counters)
    assert {s["spec"]["pool"]["generation"] for s in slices} == {1}
    dev = mig_device_name(0, "1g.10gb", 19, 3)
    # the H100 is offered whole too; the A100 in MIG mode is not (turning MIG mode off needs a
    # GPU reset there)
    assert dev in devices and "gpu-0" in devices and "gpu-1" not in devices
    assert mig_device_name(1, "1g.5gb", 19, 0) in devices
    assert wait_for("readiness", lambda: _get(p.url("/readyz"))[0] == 200)

    # a claim allocated by another client through the status subresource
    path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    claim = kube.request(
        "POST",
        path,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "slice"},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "mig.carve.dev"}}]}},
        },
    )  # fmt: skip
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": dev}]
            },
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
            "allocationTimestamp": now,
        }
    }  # fmt: skip
    kube.request("PUT", f"{path}/slice/status", body=claim)
    ref = ClaimRef(namespace, "slice", claim["metadata"]["uid"])

    res = plugin.prepare([ref])[ref.uid]
    assert res.error == "", res.error
    (prepared,) = res.devices
    assert prepared.device_name == dev and prepared.pool_name == node
    edits = cdi.resolve([p.root / "cdi"], prepared.cdi_device_ids)
    assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=MIG-") for e in edits.env)
    uvm = {n["path"]: n for n in edits.device_nodes if n["path"].startswith("/dev/nvidia-uvm")}
    assert sorted(uvm) == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert uvm["/dev/nvidia-uvm"]["major"] > 0 and uvm["/dev/nvidia-uvm-tools"]["minor"] == 1
    fin = f"{DRIVER}/node-{node}"
    assert fin in kube.request("GET", f"{path}/slice")["metadata"]["finalizers"]
    wrong = ClaimRef(namespace, "slice", str(uuid.uuid4()))
    assert "now has UID" in plugin.prepare([wrong])[wrong.uid].error

    assert plugin.unprepare([ref]) == {ref.uid: ""}
    assert fin not in (kube.request("GET", f"{path}/slice")["metadata"].get("finalizers") or [])
    assert not list((p.root / "cdi").iterdir())

    # the kubelet wipes the node's slices: they come back
    for s in _slices(api, node):
        kube.request("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{s['metadata']['name']}")
    # (one generation across the pool; which one depends on whether a resync ran between two
    # of the deletes above, which then left a pool to bump rather than none)
    back = wait_for(
        "republished slices",
        lambda: (
            len(s := _slices(api, node)) >= 4
            and len({x["spec"]["pool"]["generation"] for x in s}) == 1
            and s
        ),
    )
    assert len(back) == 4

    metrics = _get(p.url("/metrics"))[1]
    assert "carve_prepare_duration_seconds_count 2.0" in metrics

    assert p.stop() == 0, p.logs()[-3000:]
    assert _slices(api, node) == []  # --cleanup-on-exit


def _allocated_claim(kube: Any, namespace: str, node: str, device: str) -> ClaimRef:
    path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
    name = f"c-{uuid.uuid4().hex[:6]}"
    claim = kube.request(
        "POST",
        path,
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "mig.carve.dev"}}]}},
        },
    )  # fmt: skip
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]
            },
            "allocationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    }
    kube.request("PUT", f"{path}/{name}/status", body=claim)
    return ClaimRef(namespace, name, claim["metadata"]["uid"])


@pytest.mark.cluster
def test_plugin_killed_mid_prepare_recovers_on_kubelet_retry(
    cluster_plugin: tuple[PluginProcess, str, Any], namespace: str
) -> None:
    import grpc

    from driver.nvml import sim
    from driver.nvml.backend import NvmlBackend
    from process.kube.jsonclient import KubeJson

    p, node, api = cluster_plugin
    kube = KubeJson(api)
    plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
    health = next(plugin.watch_health(timeout=10))
    assert {h.health for h in health} == {"HEALTHY"} and len(health) > 20
    dev = mig_device_name(1, "3g.20gb", 9, 4)
    ref = _allocated_claim(kube, namespace, node, dev)

    # the plugin dies right after NVML created the compute instance (the reply is lost)
    p.stop()
    p.start(env={"CARVE_SIM_FAULT_TAG": "plugin"})
    sim.configure(p.sim_config)
    try:
        sim.sim_crash_at("after:GpuInstanceCreateComputeInstance", tag="plugin")
        plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
        with pytest.raises(grpc.RpcError):
            plugin.prepare([ref])
        assert p.proc.wait(timeout=10) == -9
        p.kubelet.close()
        p.log.close()

        # Restarted by the DaemonSet. The killed process left its sockets behind, so a kubelet
        # scanning meanwhile would fail on them; register once the new process serves.
        runs = p.logs().count("carve kubelet plugin running")
        p.start()
        wait_for("restart", lambda: p.logs().count("carve kubelet plugin running") > runs)
        p.kubelet = KubeletSim(p.registry)
        plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
        res = plugin.prepare([ref])[ref.uid]
        assert res.error == "", res.error
        with NvmlBackend(sim, proc_root=sim.sim_proc_root()) as b:
            live = [
                (g.minor, i.profile_id, i.placement.start)
                for g in b.gpus()
                if b.mig_enabled(g.uuid)
                for i in b.instances(g.uuid)
            ]
        assert live == [(1, 9, 4)]  # carved once, the interrupted one rolled back
        assert plugin.unprepare([ref]) == {ref.uid: ""}
        claim = kube.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}"
                                    f"/resourceclaims/{ref.name}")  # fmt: skip
        assert not claim["metadata"].get("finalizers")
    finally:
        sim.configure(None)


@pytest.mark.cluster
def test_restart_releases_claims_that_vanished_from_the_api_before_serving(
    cluster_plugin: tuple[PluginProcess, str, Any], namespace: str
) -> None:
    """A node that comes back to a cluster which no longer has its claims (rebuilt cluster,
    finalizers stripped by hand) must free those placements at start-up, not only at the
    first periodic housekeeping pass 30 s later. Registration does not wait for it (issue
    45: a slow apiserver must not hold it back), so the prepare waits for the release."""
    from process.kube.jsonclient import KubeJson

    p, node, api = cluster_plugin
    kube = KubeJson(api)
    plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
    dev = mig_device_name(0, "3g.40gb", 9, 4)
    old = _allocated_claim(kube, namespace, node, dev)
    assert plugin.prepare([old])[old.uid].error == ""

    # The plugin goes down with the instance carved; meanwhile the claim disappears.
    p.stop()
    path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{old.name}"
    kube.request("PATCH", path, body={"metadata": {"finalizers": None}},
                 content_type="application/merge-patch+json")  # fmt: skip
    kube.request("DELETE", path)

    runs = p.logs().count("carve kubelet plugin running")
    p.start()
    wait_for("restart", lambda: p.logs().count("carve kubelet plugin running") > runs)
    p.kubelet = KubeletSim(p.registry)
    plugin = p.kubelet.wait_for_plugin(DRIVER, timeout=30)
    wait_for("the start-up release", lambda: "releasing claim that no longer exists in the API"
             in p.logs(), timeout=15)  # fmt: skip
    new = _allocated_claim(kube, namespace, node, dev)
    res = plugin.prepare([new])[new.uid]
    assert res.error == "", res.error
    assert plugin.unprepare([new]) == {new.uid: ""}


@pytest.mark.cluster
def test_two_machines_with_one_node_name_end_in_a_node_event_not_a_fight(
    k8s_cluster: Any, fake_node: Callable[..., str], tmp_path: Path
) -> None:
    """Two real plugin processes, each with its own GPUs, are given one --node-name (a copied
    machine image): the one whose slices were rewritten stops publishing, fails /readyz and
    posts a ResourceSliceConflict event on the Node, while the slices stay the other's; once
    the other machine is gone and the kubelet has deleted its slices, the first publishes
    again. Neither process crashes."""
    from driver.catalog import CATALOG
    from driver.contract import Attr
    from kubeletplugin.nodeevents import NODE_EVENT_NAMESPACE
    from process.kube.jsonclient import KubeJson

    h100, a30 = CATALOG["H100-SXM5-80GB"].product_name, CATALOG["A30-24GB"].product_name
    node = fake_node()
    api = k8s_cluster.api_client()

    def _readyz(p: PluginProcess) -> tuple[int, str]:
        try:
            return _get(p.url("/readyz?verbose"))
        except urllib.error.URLError:  # not serving yet
            return 0, ""

    def syncs(p: PluginProcess) -> float:
        """The plugin's finished ResourceSlice passes (one per resync, ours at 1s)."""
        text = _get(p.url("/metrics"))[1]
        found = re.search(r'^carve_resourceslice_sync_total\{result="ok"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    kube = KubeJson(api)

    def models() -> set[str]:
        return {
            str(d["attributes"][Attr.PRODUCT_NAME]["string"])
            for s in _slices(api, node)
            for d in s["spec"].get("devices") or ()
        }

    first = PluginProcess(
        tmp_path / "a", node, k8s_cluster.info.kubeconfig, gpus=("H100-SXM5-80GB",)
    )
    second: PluginProcess | None = None
    try:
        first.kubelet.wait_for_plugin(DRIVER, timeout=30)
        wait_for("first plugin ready", lambda: _readyz(first)[0] == 200, timeout=60)
        assert models() == {h100}, models()

        second = PluginProcess(
            tmp_path / "b", node, k8s_cluster.info.kubeconfig, gpus=("A30-24GB",)
        )
        second.kubelet.wait_for_plugin(DRIVER, timeout=30)
        _, body = wait_for(
            "the first plugin to report the conflict on /readyz",
            lambda: (r := _readyz(first))[0] == 503 and "two machines" in r[1] and r,
            timeout=60,
        )
        assert f"node name {node!r}" in body and "--node-name" in body, body

        def conflict_events() -> list[dict[str, Any]]:
            events = kube.request(
                "GET", f"/apis/events.k8s.io/v1/namespaces/{NODE_EVENT_NAMESPACE}/events"
            )["items"]
            return [
                e
                for e in events
                if e.get("reason") == "ResourceSliceConflict"
                and (e.get("regarding") or {}).get("name") == node
            ]

        (event,) = wait_for("a ResourceSliceConflict event on the Node", conflict_events)
        assert event["type"] == "Warning" and node in event["note"], event
        # Three more passes of the first, each of which found the conflict: it keeps off.
        seen = syncs(first)
        wait_for("three resyncs of the first", lambda: syncs(first) >= seen + 3, timeout=60)
        assert models() == {a30}, models()
        assert len(conflict_events()) == 1  # said once, not every resync

        # The second machine goes away; the kubelet deletes its slices (30 s later, in life).
        second.proc.kill()
        second.proc.wait(timeout=30)
        for s in _slices(api, node):
            kube.request(
                "DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{s['metadata']['name']}"
            )
        wait_for("the first to publish again", lambda: models() == {h100})
        wait_for("the first ready again", lambda: _readyz(first)[0] == 200)
        assert first.proc.poll() is None
    finally:
        for p in (first, second):
            if p is not None and p.proc.poll() is None:
                p.stop()
            elif p is not None:
                p.kubelet.close()
                p.log.close()
    assert "ResourceSlice conflict" in first.logs()
