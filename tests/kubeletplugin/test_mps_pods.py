"""MPS control daemons in pods of their own (--mps-daemon-image, the chart's way): a claim's
daemon runs in a pod on this node that outlives the plugin, a new plugin adopts it, and it is
gone before the claim's slice is.

The apiserver and the kubelet are tests/kubeletplugin/fake_kubelet.py, which runs each pod's
command as a local process; the daemon is the simulator's nvidia-cuda-mps-control stand-in,
driven by the plugin's own code. tests/realnode/test_in_cluster.py runs the same pods on a real
kubelet and containerd.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from driver.cdi import CdiWriter
from driver.driverroot import discover
from driver.nvml import sim
from driver.nvml.sim.mpscontrol import CONTROL_LOG
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.claims import KubernetesClaimEvents
from kubeletplugin.mps import MpsControl, find_binary
from kubeletplugin.mpspods import APP, CONTAINER, POD_PREFIX, DaemonPods, PodSettings
from kubeletplugin.nodehardware import NodeHardware
from kubeletplugin.prepare import Preparer, PreparerSettings
from process.kube.jsonclient import KubeJson
from tests.kubeletplugin.fake_kubelet import FakeKubelet
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, mps_config, open_node

H100 = "H100-SXM5-80GB"
NAMESPACE = "carve-system"
IMAGE = "ghcr.io/carve-dev/carve:test"
EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/default/events"


class Env:
    """A node whose plugin runs MPS daemons in pods; `restart()` is a new plugin process (the
    pods, like the GPUs, stay)."""

    def __init__(self, node: Node, tmp_path: Path, kubelet: FakeKubelet) -> None:
        self.node = node
        self.tmp_path = tmp_path
        self.kubelet = kubelet
        self.p = self._plugin()

    def _plugin(self) -> Preparer:
        api = cast(KubeJson, self.kubelet)
        driver = self.tmp_path / "driver"
        files = discover(driver, version=self.node.backend.gpus()[0].driver_version, hook_dirs=())
        pods = DaemonPods(
            api,
            PodSettings(
                NAMESPACE,
                IMAGE,
                NODE,
                DRIVER,
                driver_root=driver,
                start_timeout=30,
                service_account="carve-mps-daemon",
            ),
            gone_timeout=5,
        )
        self.mps = MpsControl(
            find_binary(driver), self.tmp_path / "plugins" / DRIVER / "mps", timeout=30, pods=pods
        )
        p = Preparer(
            settings=PreparerSettings(DRIVER, NODE, NODE),
            backend=self.node.backend,
            claims=self.node.claims,
            store=CheckpointStore(self.node.checkpoint_dir),
            cdi=CdiWriter(self.node.cdi_root, vendor=DRIVER),
            shared_edits=files.spec_edits(),
            dev_root=self.tmp_path / "devroot",
            mps=self.mps,
            events=KubernetesClaimEvents(api, driver=DRIVER, node=NODE),
        )
        self.node.preparer = p
        p.reconcile()
        self.health = NodeHardware(self.node.backend, sim.sim_proc_root()).health_source(
            DRIVER, NODE, p.refused_gpus, p.mps_down_devices
        )
        return p

    def restart(self) -> None:
        self.p.close()
        self.p = self._plugin()

    def instances(self) -> int:
        return sum(len(list(self.node.backend.instances(g.uuid))) for g in self.node.backend.gpus())

    def events(self) -> list[dict[str, Any]]:
        return [body for method, path, body in self.kubelet.requests if path == EVENTS_PATH]

    def health_of(self, device: str) -> tuple[bool, str]:
        (entry,) = [(ok, why) for _, name, ok, why in self.health() if name == device]
        return entry


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    n = open_node(tmp_path, [H100])
    sim.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    kubelet = FakeKubelet()
    e = Env(n, tmp_path, kubelet)
    yield e
    kubelet.close()  # never leave a daemon behind a failed test
    e.p.close()
    n.backend.close()
    sim.configure(None)


def _pod_name(uid: str) -> str:
    return f"{POD_PREFIX}{uid}"


def test_a_claims_daemon_runs_in_a_pod_of_its_own_on_this_node(env: Env, tmp_path: Path) -> None:
    dev = mig(env.node.backend, 0, 19, 3)
    ref = env.node.claims.add("shared", [dev], config=mps_config(defaultActiveThreadPercentage=40))
    assert env.p.prepare([ref])[ref.uid].error == ""

    rec = env.p.checkpoint().claims[ref.uid].mps
    assert rec is not None
    assert rec.pod == f"{NAMESPACE}/{_pod_name(ref.uid)}" and rec.pid is None
    pod = env.kubelet.pod(NAMESPACE, _pod_name(ref.uid))
    assert pod is not None
    spec = pod["spec"]
    assert spec["nodeName"] == NODE and spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == "carve-mps-daemon"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == APP
    assert pod["metadata"]["labels"][f"{DRIVER}/claim-uid"] == ref.uid
    (container,) = spec["containers"]
    assert container["name"] == CONTAINER and container["image"] == IMAGE
    assert container["command"] == [str(find_binary(tmp_path / "driver")), "-f"]
    assert container["securityContext"] == {"privileged": True, "runAsUser": 0}
    env_vars = {e["name"]: e["value"] for e in container["env"]}
    assert env_vars["CUDA_MPS_PIPE_DIRECTORY"] == rec.pipe_dir
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {str(Path(rec.pipe_dir).parent), str(tmp_path / "driver"), "/dev"} <= mounted
    # The daemon in the pod is the one the claim's containers reach, configured.
    assert env.mps.command(rec, "get_default_active_thread_percentage").split() == ["40.0"]

    # Unprepare: the pod is gone (its container stopped) before the slice is destroyed.
    at_delete: list[int] = []
    env.kubelet.on_delete = lambda name: at_delete.append(env.instances())
    assert env.p.unprepare([ref])[ref.uid] == ""
    assert at_delete == [1]
    assert env.kubelet.pod(NAMESPACE, _pod_name(ref.uid)) is None
    assert env.instances() == 0
    assert not Path(rec.pipe_dir).parent.exists()


def test_a_new_plugin_adopts_the_running_daemon_pod(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    ref = env.node.claims.add(
        "c", [mig(env.node.backend, 0, 19, 0)], config=mps_config(defaultActiveThreadPercentage=25)
    )
    assert env.p.prepare([ref])[ref.uid].error == ""
    process = env.kubelet.process(NAMESPACE, _pod_name(ref.uid))
    assert process is not None
    created = env.kubelet.calls("POST")

    caplog.set_level(logging.INFO, logger="kubeletplugin.mpsdaemons")
    env.restart()  # the plugin's pod is replaced; the daemon's pod is not
    assert env.kubelet.calls("POST") == created and env.kubelet.calls("DELETE") == []
    assert env.kubelet.process(NAMESPACE, _pod_name(ref.uid)) is process
    assert process.poll() is None
    assert "MPS control daemon adopted" in caplog.text
    rec = env.p.checkpoint().claims[ref.uid].mps
    assert rec is not None
    assert env.mps.command(rec, "get_default_active_thread_percentage").split() == ["25.0"]
    log = (Path(rec.log_dir) / CONTROL_LOG).read_text()
    assert log.count("Starting control daemon") == 1
    assert env.events() == []

    assert env.p.unprepare([ref])[ref.uid] == ""
    assert process.poll() is not None


def test_a_daemon_pod_that_ended_is_started_again_with_the_claims_settings(env: Env) -> None:
    dev = mig(env.node.backend, 0, 19, 1)
    ref = env.node.claims.add("c", [dev], config=mps_config(defaultActiveThreadPercentage=30))
    assert env.p.prepare([ref])[ref.uid].error == ""
    first = env.kubelet.process(NAMESPACE, _pod_name(ref.uid))
    assert first is not None
    first.kill()
    first.wait()

    env.p.retry_pending()  # housekeeping: the pod ended, so a new one replaces it
    assert env.kubelet.calls("DELETE") == [
        f"/api/v1/namespaces/{NAMESPACE}/pods/{_pod_name(ref.uid)}"
    ]
    second = env.kubelet.process(NAMESPACE, _pod_name(ref.uid))
    assert second is not None and second is not first and second.poll() is None
    rec = env.p.checkpoint().claims[ref.uid].mps
    assert rec is not None
    assert env.mps.command(rec, "get_default_active_thread_percentage").split() == ["30.0"]
    (event,) = env.events()
    assert event["reason"] == "MPSDaemonRestarted"
    assert f"pod {NAMESPACE}/{_pod_name(ref.uid)}" in event["note"]
    assert env.health_of(dev) == (
        False,
        "MPS control daemon of claim default/c is down (restarting)",
    )
    env.p.retry_pending()
    assert env.health_of(dev) == (True, "")
    assert env.p.unprepare([ref])[ref.uid] == ""


def test_an_unreachable_api_leaves_the_daemon_alone(env: Env) -> None:
    ref = env.node.claims.add("c", [mig(env.node.backend, 0, 19, 2)], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    process = env.kubelet.process(NAMESPACE, _pod_name(ref.uid))
    assert process is not None
    env.kubelet.unreachable = ConnectionError("apiserver unreachable")
    env.p.retry_pending()
    env.restart()
    env.kubelet.unreachable = None
    # Whether it ran could not be told, so it was neither restarted nor reported down.
    assert env.kubelet.calls("DELETE") == [] and len(env.kubelet.calls("POST")) == 1
    assert process.poll() is None and env.events() == []
    assert env.p.mps_down_devices() == {}
    assert env.p.unprepare([ref])[ref.uid] == ""


def test_a_pod_that_cannot_start_fails_the_prepare_with_its_reason(env: Env) -> None:
    env.kubelet.cannot_pull.add(IMAGE)
    ref = env.node.claims.add("c", [mig(env.node.backend, 0, 19, 4)], config=mps_config())
    result = env.p.prepare([ref])[ref.uid]
    assert result.reason == "mps-start-failed"
    assert f"pod {NAMESPACE}/{_pod_name(ref.uid)} cannot start its container: ErrImagePull" in (
        result.error
    )
    # Rolled back: no pod, no slice, no record.
    assert env.kubelet.pod(NAMESPACE, _pod_name(ref.uid)) is None
    assert env.instances() == 0
    assert ref.uid not in env.p.checkpoint().claims


def test_a_pod_whose_deletion_is_not_confirmed_keeps_the_slice(env: Env) -> None:
    ref = env.node.claims.add("c", [mig(env.node.backend, 0, 19, 5)], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    env.kubelet.confirm_deletions = False  # the kubelet does not say the container stopped
    error = env.p.unprepare([ref])[ref.uid]
    assert "stopping the MPS control daemon" in error and "still there" in error, error
    assert env.instances() == 1  # the daemon may still hold it
    assert env.p.checkpoint().claims[ref.uid].mps is not None
    env.kubelet.confirm_deletions = True
    assert env.p.unprepare([ref])[ref.uid] == ""  # the kubelet retries
    assert env.instances() == 0
