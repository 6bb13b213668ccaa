"""MPS inside a carved slice, on real nodes: two pods sharing one claim use the one MPS control
daemon the plugin runs on the slice, through the pipe directory the CDI spec mounts into every
container; the daemon survives a plugin crash and stops before the slice is destroyed."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from devcluster.waiting import wait_for
from kubeletplugin.mps import PID_FILE
from tests.e2e.harness import profile_is, request
from tests.realnode.conftest import NODE_H
from tests.realnode.harness import RealEnv

_MPS_CONFIG = {
    "opaque": {
        "driver": "mig.carve.dev",
        "parameters": {
            "apiVersion": "mig.carve.dev/v1alpha1",
            "kind": "MigDeviceConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 40,
                    "defaultPinnedDeviceMemoryLimit": "2Gi",
                },
            },
        },
    }
}

# Each container reports where MPS is and asks the daemon through the mounted pipe.
_MPS_SCRIPT = """\
echo "PIPE $CUDA_MPS_PIPE_DIRECTORY"
echo get_default_active_thread_percentage | nvidia-cuda-mps-control | sed 's/^/REPLY /'
"""


def _daemon_dir(env: RealEnv, claim_uid: str) -> Path:
    node = env.node_of(NODE_H)
    return node.layout.plugins_dir / env.stack.contract.driver / "mps" / claim_uid


def _daemon_pid(directory: Path) -> int | None:
    try:
        pid = int((directory / "pipe" / PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def test_two_pods_share_one_mps_daemon_on_one_slice(env: RealEnv) -> None:
    # From YAML through kubectl, as users do: kube-apiserver refuses every later metadata
    # change to a claim whose opaque parameters arrived as JSON with whitespace (the Python
    # client's encoding; docs/controller.md).
    claim_doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "mps", "namespace": env.namespace},
        "spec": {
            "devices": {
                "requests": [request("mig", [profile_is("1g.10gb")])],
                "config": [_MPS_CONFIG],
            }
        },
    }
    env.stack.kubectl("apply", "-f", "-", input=yaml.safe_dump(claim_doc))
    env.wait_gate_sees({"resourceClaimName": "mps"})
    for name in ("p1", "p2"):
        env.pod(name, {"mig": {"resourceClaimName": "mps"}}, node=NODE_H, script=_MPS_SCRIPT,
                sleep=600)  # fmt: skip
    for name in ("p1", "p2"):
        env.wait_phase(name, "Running", timeout=90)
    claim = env.claim_of("p1", "mig")
    directory = _daemon_dir(env, claim["metadata"]["uid"])
    pid = _daemon_pid(directory)
    assert pid is not None, f"no MPS daemon for the claim under {directory}"
    hardware = env.node_of(NODE_H).hardware()
    assert sum(len(gi["cis"]) for g in hardware["gpus"] for gi in g["gis"]) == 1  # one slice

    for name in ("p1", "p2"):
        logs = wait_for(
            f"{name}'s MPS reply", lambda n=name: "REPLY" in env.logs(n) and env.logs(n), 30
        )
        assert "PIPE /tmp/nvidia-mps" in logs
        assert "REPLY 40" in logs, logs  # the one daemon, with the claim's setting
    log = (directory / "log" / "control.log").read_text()
    assert "CMD set_default_active_thread_percentage 40" in log
    assert "CMD set_default_device_pinned_mem_limit 0 2048M" in log
    assert log.count("CMD get_default_active_thread_percentage") >= 2  # asked by both pods

    # A plugin crash does not take the daemon down; the restarted plugin keeps it.
    node = env.node_of(NODE_H)
    node.kill_plugin()
    node.start_plugin()
    node.wait_plugin_registered(time.monotonic() + 60)
    assert _daemon_pid(directory) == pid

    # Deleting the pods and the claim stops the daemon, then destroys the slice.
    env.delete_pod("p1")
    env.delete_pod("p2")
    env.wait_gone("p1")
    env.wait_gone("p2")
    env.resource.delete_namespaced_resource_claim("mps", env.namespace)
    env.wait_no_instances(timeout=60)
    wait_for("the MPS daemon to stop", lambda: not Path(f"/proc/{pid}").exists(), 30)
    assert not directory.exists()
