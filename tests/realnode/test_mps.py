"""MPS inside a carved slice, on real nodes: two pods sharing one claim use the one MPS control
daemon the plugin runs on the slice, through the pipe directory the CDI spec mounts into every
container; the daemon survives a plugin crash and stops before the slice is destroyed."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import yaml

from devcluster.waiting import wait_for
from kubeletplugin.mps import PID_FILE
from tests.e2e.harness import profile_is, request
from tests.realnode.harness import NODE_H, RealEnv

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

# Each container reports where MPS is, its own per-client limit, and asks the daemon through
# the mounted pipe.
_MPS_SCRIPT = """\
echo "PIPE $CUDA_MPS_PIPE_DIRECTORY"
echo "CLIENT [$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE]"
echo get_default_active_thread_percentage | nvidia-cuda-mps-control | sed 's/^/REPLY /'
"""


def _client(name: str, **env: str) -> dict[str, object]:
    """A container that uses the pod's `mig` claim and sets `env` (per-client MPS limits)."""
    return {
        "name": name,
        "resources": {"claims": [{"name": "mig"}]},
        "env": [{"name": k, "value": v} for k, v in env.items()],
    }


def _event(env: RealEnv, pod: str, reason: str) -> str:
    def found() -> str | None:
        for e in env.events("Pod", pod):
            if e["reason"] == reason:
                return str(e["message"])
        return None

    return wait_for(f"a {reason} event on {pod}", found, 30)


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
    # p1 sets a per-client limit in its own environment; p2 leaves the daemon's default.
    shared = {"mig": {"resourceClaimName": "mps"}}
    limited = _client("main", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25")
    env.pod("p1", shared, node=NODE_H, script=_MPS_SCRIPT, sleep=600, containers=[limited])
    env.pod("p2", shared, node=NODE_H, script=_MPS_SCRIPT, sleep=600)
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
    # The CDI spec sets no limit variable, so a container's own reaches CUDA unchanged.
    assert "CLIENT [25]" in env.logs("p1")
    assert "CLIENT []" in env.logs("p2")
    log = (directory / "log" / "control.log").read_text()
    assert "CMD set_default_active_thread_percentage 40" in log
    assert "CMD set_default_device_pinned_mem_limit 0 2048M" in log
    assert log.count("CMD get_default_active_thread_percentage") >= 2  # asked by both pods

    # A third pod would join the shared claim asking for more pinned memory than its slice has,
    # and a fourth with a thread percentage CUDA cannot read: both wait with the reason.
    env.pod("greedy", {"mig": {"resourceClaimName": "mps"}}, node=NODE_H,
            containers=[_client("main", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=16G")])  # fmt: skip
    env.pod("badpct", {"mig": {"resourceClaimName": "mps"}}, node=NODE_H,
            containers=[_client("main", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="150")])  # fmt: skip
    greedy = _event(env, "greedy", "InvalidMpsSettings")
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 16384Mi is more than the" in greedy, greedy
    badpct = _event(env, "badpct", "InvalidMpsSettings")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='150': must be an integer from 1 to 100" in badpct
    for name in ("greedy", "badpct"):
        pod = env.raw_pod(name)
        assert pod is not None and not pod["spec"].get("nodeName"), pod
        env.delete_pod(name)

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


def test_bad_mps_settings_are_refused_before_anything_is_carved(env: RealEnv) -> None:
    def claim(name: str, req: dict[str, object], mps: dict[str, object] | None) -> None:
        config = []
        if mps is not None:
            params = copy.deepcopy(_MPS_CONFIG)
            params["opaque"]["parameters"]["sharing"]["mpsConfig"] = mps  # type: ignore[index]
            config = [params]
        doc = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": env.namespace},
            "spec": {"devices": {"requests": [req], "config": config}},
        }
        env.stack.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        env.wait_gate_sees({"resourceClaimName": name})

    one_g = request("mig", [profile_is("1g.10gb")])
    claim("big", one_g, {"defaultPinnedDeviceMemoryLimit": "20Gi"})
    claim("plain", one_g, None)
    whole_gpu = {"name": "gpu", "exactly": {"deviceClassName": "gpu.carve.dev"}}
    claim("whole", whole_gpu, {"defaultPinnedDeviceMemoryLimit": "100Gi"})  # more than the GPU
    env.pod("big", {"mig": {"resourceClaimName": "big"}}, node=NODE_H)
    env.pod("plain", {"mig": {"resourceClaimName": "plain"}}, node=NODE_H,
            containers=[_client("main", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="30")])  # fmt: skip
    env.pod("whole", {"mig": {"resourceClaimName": "whole"}}, node=NODE_H)

    big = _event(env, "big", "MpsLimitTooLarge")
    assert "an MPS pinned device memory limit of 20480Mi applies to it" in big, big
    assert "the largest device it matches has" in big
    plain = _event(env, "plain", "InvalidMpsSettings")
    assert "no carve claim it uses (plain) has MPS sharing" in plain, plain
    whole = _event(env, "whole", "MpsLimitTooLarge")
    assert "an MPS pinned device memory limit of 102400Mi applies to it" in whole, whole
    # The claims say it too (kubectl describe resourceclaim), and nothing was carved.
    wait_for(  # the claim's event has its own write: it may land after the pod's
        "a MpsLimitTooLarge event on claim big",
        lambda: [e["reason"] for e in env.events("ResourceClaim", "big")],
        until=lambda reasons: "MpsLimitTooLarge" in reasons,
        timeout=30,
    )
    for name in ("big", "plain", "whole"):
        assert not env.resource.read_namespaced_resource_claim(
            name, env.namespace
        ).status.allocation
    hardware = env.node_of(NODE_H).hardware()
    assert sum(len(g["gis"]) for g in hardware["gpus"]) == 0
