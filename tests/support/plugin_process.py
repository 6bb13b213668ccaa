"""The real carve-kubelet-plugin as a process on a simulated node, beside the kubelet stand-in
(nodesim.kubelet) that registers it: for the plugin's process tests (tests/kubeletplugin/)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from nodesim.kubelet import KubeletSim

REPO = Path(__file__).resolve().parents[2]
DRIVER = "mig.carve.dev"
PLUGIN = str(Path(sys.executable).with_name("carve-kubelet-plugin"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PluginProcess:
    """The real carve-kubelet-plugin on a simulated node; `start()` again after a crash."""

    def __init__(
        self,
        root: Path,
        node: str,
        kubeconfig: Path,
        *extra: str,
        gpus: tuple[Any, ...] = ("H100-SXM5-80GB", {"model": "A100-SXM4-40GB"}),
        faults: tuple[dict[str, Any], ...] = (),
        run: bool = True,
    ) -> None:
        """`run=False` leaves the process to a later `start()` (e.g. after `seed_checkpoint`)."""
        self.root = root
        self.node = node
        self.kubeconfig = kubeconfig
        self.extra = extra
        self.sim_config = root / "sim.yaml"
        root.mkdir(parents=True, exist_ok=True)
        self.sim_config.write_text(
            yaml.safe_dump(
                {"state": str(root / "sim-state.json"), "uuid_seed": str(root),
                 "gpus": list(gpus), "faults": list(faults)}
            )
        )  # fmt: skip
        self.registry = root / "registry"
        self.kubelet = KubeletSim(self.registry)
        if run:
            self.start()

    def start(self, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = open(self.root / "plugin.log", "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                PLUGIN,
                "--node-name", self.node,
                "--kubeconfig", str(self.kubeconfig),
                "--simulate", str(self.sim_config),
                "--registry-dir", str(self.registry),
                "--plugins-dir", str(self.root / "plugins"),
                "--cdi-root", str(self.root / "cdi"),
                "--http-address", f"127.0.0.1:{self.port}",
                "--resync-period", "1s",
                *self.extra,
            ],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )  # fmt: skip

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def logs(self) -> str:
        return (self.root / "plugin.log").read_text()

    def stop(self) -> int:
        self.kubelet.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # no process outlives its test, however it failed
            self.proc.wait()
            raise
        finally:
            self.log.close()
        return rc


def unreachable_kubeconfig(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1",
                                                      "insecure-skip-tls-verify": True}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )  # fmt: skip
    return path


def seed_checkpoint(p: PluginProcess, *, prepared: int, interrupted: int = 0) -> list[str]:
    """Write the checkpoint a crashed plugin on `p`'s node would leave: `prepared` claims
    recorded PrepareCompleted (each a MIG device not carved yet, so only housekeeping's claim
    read concerns it) and `interrupted` ones in PrepareStarted (torn down at start, which
    removes their finalizer through the API). Returns the claims' UIDs. Call before `start`."""
    from driver.nvml import sim
    from kubeletplugin.checkpoint import (
        Checkpoint,
        CheckpointStore,
        ClaimRecord,
        ClaimState,
        DeviceRecord,
    )

    sim.configure(p.sim_config)
    try:
        gpu = sim.sim_snapshot()["gpus"][0]["uuid"]
    finally:
        sim.configure(None)
    records = {}
    for i in range(prepared + interrupted):
        uid = f"00000000-0000-4000-8000-{i:012d}"
        state = ClaimState.PREPARE_COMPLETED if i < prepared else ClaimState.PREPARE_STARTED
        device = DeviceRecord(
            f"gpu-0-mig-19-{i % 7}-1", ("r",), p.node, gpu, 0,
            profile_id=19, placement_start=i % 7, placement_size=1,
        )  # fmt: skip
        records[uid] = ClaimRecord(uid, "default", f"claim-{i}", state, (device,), True)
    CheckpointStore(p.root / "plugins" / DRIVER).save(Checkpoint(claims=records))
    return list(records)
