"""One real GPU node on this machine: containerd, the real kubelet and carve's kubelet plugin on
simulated GPUs, wired together the way a production node is.

The kubelet finds the plugin through its own plugins_registry, calls it over the plugin's
unix socket when it prepares a claim, and hands the CDI device IDs the plugin returns to
containerd, which resolves them from the node's CDI directory and gives the container its
device nodes, environment and driver files. Nothing in between is carve's.

Start order matters: containerd before the kubelet (the kubelet refuses to start without its
runtime), the kubelet before the plugin is registered (the plugin re-registers whenever the
kubelet comes back). Stop order is the reverse, then ``cleanup.clean_node`` removes what the
runtime leaves behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devcluster.processes import ManagedProcess, tail_of
from driver.contract import DEFAULT_DRIVER_NAME
from nodesim.invariants import NodeHardware
from nodesim.simnode import (
    check_gpu_keys,
    hardware_view,
    plugin_argv,
    read_hardware,
    write_sim_config,
)
from process.kube.errors import ApiError
from process.kube.jsonclient import KubeJson
from realnode import cleanup, configs, images
from realnode.binaries import NodeBinaries
from realnode.layout import NodeLayout

_log = logging.getLogger(__name__)

GPU_COUNT_LABEL = "realnode.carve.dev/gpus"


class NodeStartError(RuntimeError):
    """A component of the node did not come up; the message carries its log tail."""


@dataclass(frozen=True)
class RealNodeSpec:
    """A node to run: its simulated GPUs by catalog key and the simulator's latency preset."""

    name: str
    gpus: tuple[str, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    latency: str = "zero"

    def __post_init__(self) -> None:
        check_gpu_keys(self.name, self.gpus)


class RealNode:
    """Start with ``start()``; ``restart_kubelet()`` and ``kill_plugin()`` are the faults the
    real-node suite injects."""

    def __init__(
        self,
        spec: RealNodeSpec,
        layout: NodeLayout,
        binaries: NodeBinaries,
        kubeconfig: Path,
        api_client: Any,
        *,
        detached: bool = False,
        driver: str = DEFAULT_DRIVER_NAME,
        plugin_args: Sequence[str] = (),
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.binaries = binaries
        self.kubeconfig = kubeconfig
        self.api = KubeJson(api_client)
        self.driver = driver
        self.plugin_args = tuple(plugin_args)
        self._detached = detached
        self._containerd: ManagedProcess | None = None
        self._kubelet: ManagedProcess | None = None
        self._plugin: ManagedProcess | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    # -- lifecycle -----------------------------------------------------------------------------

    def start(
        self,
        archives: Sequence[images.ImageArchive],
        timeout: float = 120.0,
        *,
        host_plugin: bool = True,
    ) -> RealNode:
        """Containerd with ``archives`` imported, the kubelet, and (``host_plugin``) carve's
        plugin as a process of this machine; without it the node waits for a plugin that
        something else runs, such as the chart's DaemonSet in a container."""
        deadline = time.monotonic() + timeout
        self._write_files()
        self.start_containerd(deadline)
        images.import_archives(self.binaries.ctr, self.layout.containerd_socket, archives)
        self.start_kubelet()
        self.wait_node_ready(deadline)
        if host_plugin:
            self.start_plugin()
            self.wait_plugin_registered(deadline)
        return self

    def _write_files(self) -> None:
        lay = self.layout
        for d in (lay.root, lay.cni_conf_dir, lay.cni_ipam_dir, lay.cdi_dir, lay.kubelet_root):
            d.mkdir(parents=True, exist_ok=True)
        lay.containerd_config.parent.mkdir(parents=True, exist_ok=True)
        lay.containerd_config.write_text(
            configs.containerd_config(
                lay,
                pause_image=images.PAUSE_IMAGE,
                runc=self.binaries.runc,
                cni_bin_dirs=(self.binaries.cni_bin_dir,),
            )
        )
        (lay.cni_conf_dir / "10-carve.conflist").write_text(
            json.dumps(configs.cni_conflist(lay), indent=2)
        )
        lay.kubelet_config.write_text(yaml.safe_dump(configs.kubelet_config(lay), sort_keys=False))
        shutil.copyfile(self.kubeconfig, lay.kubelet_kubeconfig)
        lay.kubelet_kubeconfig.chmod(0o600)
        _make_cgroup_root(lay.cgroup_root)
        write_sim_config(lay.sim_config, self.name, self.spec.gpus, self.spec.latency)
        lay.state_file.write_text(
            json.dumps(
                {
                    "name": self.name,
                    "bridge": lay.bridge,
                    "node_ip": lay.node_ip,
                    "root": str(lay.root),
                }
            )
        )

    def start_containerd(self, deadline: float) -> None:
        env = {**os.environ, "PATH": f"{self.binaries.node_bin_dir}:{os.environ.get('PATH', '')}"}
        self._containerd = ManagedProcess(
            f"containerd[{self.name}]",
            [str(self.binaries.containerd), f"--config={self.layout.containerd_config}"],
            self.layout.containerd_log,
            tie_to_parent=not self._detached,
            env=env,
        )
        self._wait(self._containerd, deadline, self._containerd_ready)

    def _containerd_ready(self) -> bool:
        done = subprocess.run(
            [str(self.binaries.ctr), "--address", str(self.layout.containerd_socket), "version"],
            capture_output=True,
            check=False,
            timeout=10,
        )
        return done.returncode == 0

    def start_kubelet(self) -> None:
        labels = {GPU_COUNT_LABEL: str(len(self.spec.gpus)), **self.spec.labels}
        argv = configs.kubelet_args(self.binaries.kubelet, self.layout, labels)
        self._kubelet = ManagedProcess(
            f"kubelet[{self.name}]",
            argv,
            self.layout.kubelet_log,
            tie_to_parent=not self._detached,
        )

    def stop_kubelet(self, sig: int = signal.SIGTERM) -> None:
        if self._kubelet is not None:
            self._kubelet.kill(sig)

    def restart_kubelet(self, timeout: float = 90.0) -> None:
        """Stop the kubelet and start it again, as an operator's `systemctl restart kubelet`."""
        self.stop_kubelet()
        self.start_kubelet()
        self.wait_node_ready(time.monotonic() + timeout)

    def kubelet_running(self) -> bool:
        return self._kubelet is not None and self._kubelet.exit_code() is None

    def wait_node_ready(self, deadline: float) -> None:
        assert self._kubelet is not None
        self._wait(self._kubelet, deadline, self._node_ready)

    def _node_ready(self) -> bool:
        try:
            node = self.api.request("GET", f"/api/v1/nodes/{self.name}")
        except ApiError:
            return False
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        taints = (node.get("spec") or {}).get("taints") or []
        return ready and not any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints)

    # -- carve's plugin ------------------------------------------------------------------------

    def start_plugin(self, *extra: str) -> None:
        """Start carve's plugin; ``extra`` flags come after the node's own (last one wins)."""
        if self._plugin is not None and self._plugin.exit_code() is None:
            raise RuntimeError(f"node {self.name}: the plugin is already running")
        lay = self.layout
        (self._plugin_port,) = free_ports(1)
        argv = plugin_argv(
            node_name=self.name,
            driver=self.driver,
            kubeconfig=self.kubeconfig,
            registry_dir=lay.registry_dir,
            plugins_dir=lay.plugins_dir,
            cdi_dir=lay.cdi_dir,
            sim_config=lay.sim_config,
            http_address=f"127.0.0.1:{self._plugin_port}",
            extra=(
                f"--driver-root={lay.driver_root}",
                f"--dev-root={lay.dev_root}",
                *self.plugin_args,
                *extra,
            ),
        )
        self._plugin = ManagedProcess(
            f"carve-kubelet-plugin[{self.name}]",
            argv,
            lay.plugin_log,
            tie_to_parent=not self._detached,
        )

    def kill_plugin(self, sig: int = signal.SIGKILL) -> None:
        """Kill the plugin process (SIGKILL by default: a crash, nothing cleaned up)."""
        if self._plugin is not None:
            self._plugin.kill(sig)

    def plugin_running(self) -> bool:
        return self._plugin is not None and self._plugin.exit_code() is None

    def wait_plugin_registered(self, deadline: float) -> None:
        """Until the plugin says (on /readyz) the kubelet registered it and its slices are out."""
        assert self._plugin is not None
        self._wait(self._plugin, deadline, self._plugin_ready)

    def _plugin_ready(self) -> bool:
        import urllib.error
        import urllib.request

        url = f"http://127.0.0.1:{self._plugin_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    # -- inspection ----------------------------------------------------------------------------

    def hardware(self) -> dict[str, Any]:
        return read_hardware(self.layout.sim_config)

    def hardware_view(self) -> NodeHardware:
        """The node's GPU instances as invariant-checker slots (the same checks as nodesim)."""
        return hardware_view(self.name, self.spec.gpus, self.layout.sim_config)

    def log_tails(self, lines: int = 25) -> str:
        lay = self.layout
        parts = []
        for label, path in (
            ("plugin", lay.plugin_log),
            ("kubelet", lay.kubelet_log),
            ("containerd", lay.containerd_log),
        ):
            parts.append(f"--- {self.name} {label} ({path}) ---\n{tail_of(path, lines)}")
        return "\n".join(parts)

    # -- teardown ------------------------------------------------------------------------------

    def stop(self, *, delete: bool = True) -> list[str]:
        """Stop every process of the node and remove what the runtime left behind."""
        for proc in (self._plugin, self._kubelet, self._containerd):
            if proc is not None:
                proc.stop(grace_seconds=5.0)
        done = cleanup.clean_node(
            self.layout.root,
            self.name,
            self.layout.bridge,
            self.layout.node_ip,
            remove_dir=delete,
        )
        if delete:
            try:
                self.api.request("DELETE", f"/api/v1/nodes/{self.name}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
        return done

    def reboot(
        self,
        archives: Sequence[images.ImageArchive],
        *,
        while_down: Callable[[], None] = lambda: None,
        timeout: float = 120.0,
    ) -> None:
        """What a reboot does to the node: every process dies (containers too), what lives in
        memory or tmpfs is gone (containerd's state, the CDI specs under /var/run/cdi), and
        what is on disk stays (the kubelet's and the plugin's checkpoints, images). Then its
        units start again: containerd, the kubelet, carve's plugin. ``while_down`` runs in
        between (the simulated GPUs' own reboot, a boot-time layout agent)."""
        self.stop(delete=False)
        for volatile in (self.layout.containerd_state, self.layout.cdi_dir):
            shutil.rmtree(volatile, ignore_errors=True)
        cleanup.claim_node_ip(self.layout.node_ip)
        while_down()
        self.start(archives, timeout)

    # -- helpers -------------------------------------------------------------------------------

    def _wait(self, proc: ManagedProcess, deadline: float, ready: Callable[[], bool]) -> None:
        while True:
            if proc.exit_code() is not None:
                raise NodeStartError(
                    f"node {self.name}: {proc.name} exited with {proc.exit_code()}:\n"
                    f"{tail_of(proc.log_path, 40)}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise NodeStartError(
                    f"node {self.name}: {proc.name} not ready in time; log "
                    f"{proc.log_path}:\n{tail_of(proc.log_path, 40)}"
                )
            time.sleep(0.2)


def _make_cgroup_root(cgroup_root: str) -> None:
    """The kubelet refuses a --cgroup-root that does not exist in every v1 hierarchy."""
    base = Path("/sys/fs/cgroup")
    if not base.is_dir():
        return
    for hierarchy in base.iterdir():
        if hierarchy.is_dir() and not hierarchy.is_symlink() and hierarchy.name != "unified":
            (hierarchy / cgroup_root.lstrip("/")).mkdir(exist_ok=True)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback right now (held together while picked)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
