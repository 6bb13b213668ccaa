"""carve-controller as a real process against a real control plane, and what the controller's
cluster suites (tests/controller/cluster/) check after it: every allocation consistent with
the published slices, and the bound pods."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from kubernetes import client
from kubernetes.client import ApiClient

from controller.objects import Kind
from controller.planner import EnginePlanner
from driver.apiobject import Obj
from tests.controller.cluster.objects import allocated_devices, claims_of, pods_of, raw


class ControllerProcess:
    """`carve-controller` started as its console script, with logs kept for post-mortems.
    `env`: variables set on top of this process's own (a chart's `CARVE_*` settings)."""

    def __init__(
        self,
        kubeconfig: Path,
        lease_ns: str,
        log: Path,
        identity: str,
        extra: list[str],
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = [
            str(Path(sys.executable).parent / "carve-controller"),
            "--kubeconfig",
            str(kubeconfig),
            "--lease-namespace",
            lease_ns,
            "--identity",
            identity,
            "--http-address",
            "",
            "--log-format",
            "text",
            "--lease-duration",
            "4s",
            "--renew-deadline",
            "3s",
            "--retry-period",
            "1s",
            "--retry-interval",
            "2s",
            *extra,
        ]
        self.log = log
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ControllerProcess:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def node_of(claim: Obj) -> str:
    alloc = claim["status"]["allocation"]
    return str(alloc["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0])


def assert_consistent(api: ApiClient, ns: str) -> None:
    """No device twice, no overlapping memory slices on any GPU, pods bound where allocated."""
    claims = claims_of(api, ns)
    devices = allocated_devices(claims)
    assert len(devices) == len(set(devices)), f"double allocation: {sorted(devices)}"
    planner = EnginePlanner()
    for s in raw(client.ResourceV1Api(api).list_resource_slice(_preload_content=False))["items"]:
        planner.observe(Kind.SLICE, s)
    planner.flush()
    per_gpu: dict[str, list[tuple[int, int]]] = {}
    for pool, device in devices:
        hit = planner.model.device(pool, device)
        assert hit is not None, f"{pool}/{device} is not published"
        per_gpu.setdefault(hit[0].uuid, []).append((hit[1].profile_id, hit[1].start))
    for uuid, instances in per_gpu.items():
        planner.model.gpus[uuid].geometry.state_of(instances)
    by_name = {c["metadata"]["name"]: c for c in claims}
    for p in pods_of(api, ns):
        node = p["spec"].get("nodeName")
        for st in (p.get("status") or {}).get("resourceClaimStatuses") or []:
            c = by_name.get(st.get("resourceClaimName"))
            if node and c is not None and (c.get("status") or {}).get("allocation"):
                assert node_of(c) == node


def bound_pods(api: ApiClient, ns: str) -> list[Obj]:
    return [p for p in pods_of(api, ns) if p["spec"].get("nodeName")]
