"""Per-test view of the real-node suite: its own namespace, pods with real containers pinned to
the suite's real nodes, and readers for what those containers printed.

The nodes (real kubelet, containerd, carve's plugin on simulated GPUs) are started once per
package and shared; every test cleans up after itself and the teardown checks that no MIG
instance is left, so a leak fails the test that caused it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.naming import parse_device_name
from nodesim.stack import CarveStack
from realnode.cluster import RealNodes
from realnode.images import TEST_IMAGE
from realnode.node import RealNode
from tests.e2e.harness import E2E

REAL_GROUP_LABEL = "realnode.carve.dev/suite"
REAL_GROUP = "on"
REAL_NAMESPACES = {"realnode.carve.dev/gated": "on"}
# The package's two nodes (conftest.py): one GPU each, so that a test knows where its slice
# lands; two models, two nodes.
NODE_A = "rn-a100"
NODE_H = "rn-h100"

# What each test container prints: its GPU environment, the device nodes it was given, the
# driver files mounted into it, and what the nvidia-smi stand-in says. Markers make it parseable.
REPORT_SCRIPT = """\
echo "ENV NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"
for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -e "$f" ] && echo "DEV $(stat -c '%t %T %n' "$f")"
done
grep -E ' (/usr/bin/nvidia-smi|/usr/lib[^ ]*/lib(nvidia|cuda)[^ ]*|/lib/firmware[^ ]*) ' \
  /proc/mounts | while read -r src dst rest; do echo "MOUNT $dst $rest"; done
nvidia-smi -L | sed 's/^/SMI /'
"""


class RealEnv(E2E):
    """An E2E whose pods run on the package's real nodes, in real containers."""

    def __init__(self, stack: CarveStack, real: RealNodes, test_name: str) -> None:
        super().__init__(stack, test_name, REAL_NAMESPACES)
        self.real = real

    # -- pods ----------------------------------------------------------------------------------

    def pod_manifest(  # type: ignore[override]
        self,
        name: str,
        claims: Mapping[str, Obj],
        *,
        node: str | None = None,
        script: str = REPORT_SCRIPT,
        sleep: float | None = None,
        containers: Sequence[Obj] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Obj:
        """A pod whose one container (or ``containers``) runs ``script`` then, with ``sleep``,
        stays up that long. Each container uses every claim entry unless it says otherwise."""
        command = script + (f"\nsleep {sleep}\n" if sleep else "")
        if containers is None:
            containers = [{"name": "main", "resources": {"claims": [{"name": e} for e in claims]}}]
        selector = {REAL_GROUP_LABEL: REAL_GROUP}
        if node is not None:
            selector["kubernetes.io/hostname"] = node
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 2,
                "nodeSelector": selector,
                "resourceClaims": [{"name": entry, **ref} for entry, ref in claims.items()],
                "containers": [
                    {
                        "image": TEST_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c", command],
                        **c,
                    }
                    for c in containers
                ],
            },
        }

    def logs(self, pod: str, container: str = "main") -> str:
        done = self.stack.kubectl("logs", pod, "-n", self.namespace, "-c", container, check=False)
        if done.returncode != 0:
            raise AssertionError(f"kubectl logs {pod} -c {container}: {done.stderr}")
        return done.stdout

    def node_of(self, name: str) -> RealNode:
        return self.real.nodes[name]

    # -- hardware ------------------------------------------------------------------------------

    def hardware(self, nodes: Iterable[Any] | None = None) -> Obj:
        chosen = list(nodes) if nodes is not None else list(self.real.nodes.values())
        return {n.name: n.hardware_view() for n in chosen}

    def mig_uuid_of(self, node: str, device: str) -> str:
        """The MIG UUID (compute instance) the simulator holds for a published device name."""
        parsed = parse_device_name(device)
        state = self.node_of(node).hardware()
        for gpu in state["gpus"]:
            if gpu["minor"] != parsed.minor:
                continue
            for gi in gpu["gis"]:
                if gi["start"] == parsed.placement_start and gi["cis"]:
                    return str(gi["cis"][0]["uuid"])
        raise AssertionError(f"no instance for {device} on {node}: {state['gpus']}")

    def diagnostics(self, pod_name: str | None = None) -> str:
        parts = []
        if pod_name:
            parts.append(self.describe(pod_name))
        parts.append("controller log:\n" + self.stack.controller_log_tail(25))
        for node in self.real.nodes.values():
            parts.append(node.log_tails(15))
        return "\n".join(parts)

    def wait_no_instances(self, timeout: float = 60.0) -> None:
        wait_for("every MIG instance to be destroyed", lambda: self.instance_count() == 0, timeout)


def parse_report(text: str) -> Obj:
    """The REPORT_SCRIPT output as {env, devices: {path: (major, minor)}, mounts, smi}."""
    env: dict[str, str] = {}
    devices: dict[str, tuple[int, int]] = {}
    mounts: dict[str, str] = {}
    smi: list[str] = []
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "ENV":
            key, _, value = rest.partition("=")
            env[key] = value
        elif kind == "DEV":
            major, minor, path = rest.split(" ", 2)
            devices[path] = (int(major, 16), int(minor, 16))
        elif kind == "MOUNT":
            path, _, options = rest.partition(" ")
            mounts[path] = options
        elif kind == "SMI":
            smi.append(rest)
    return {"env": env, "devices": devices, "mounts": mounts, "smi": smi}


def smi_uuids(lines: Sequence[str]) -> list[str]:
    return re.findall(r"UUID: (MIG-[0-9a-f-]+|GPU-[0-9a-f-]+)", "\n".join(lines))
