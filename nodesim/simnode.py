"""One simulated GPU node: a Node object, a real `carve-kubelet-plugin` on simulated GPUs, and
the kubelet's DRA part (`NodeAgent`) driving it.

Everything a node owns lives under one directory (test tooling; nothing here ships):

    <dir>/sim.yaml          NVML simulator config (GPU mix by catalog key, latency)
    <dir>/sim/state.json    the simulated hardware (shared by plugin and checkers)
    <dir>/registry/         the kubelet's plugins_registry
    <dir>/plugins/          the kubelet's plugins dir (DRA socket, checkpoint)
    <dir>/cdi/              CDI specs the plugin writes
    <dir>/containers/       container edits recorded per started pod
    <dir>/plugin.log        the plugin's log
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from devcluster.nodes import FakeNode, NodeHeartbeater, delete_node
from devcluster.processes import ManagedProcess, console_script, tail_of
from driver import catalog
from driver.contract import DEFAULT_DRIVER_NAME
from nodesim.invariants import NodeHardware, Slot, node_hardware
from nodesim.kubelet import KubeletSim, socket_identity
from nodesim.node_agent import AgentSettings, NodeAgent

_log = logging.getLogger(__name__)

DRIVER = DEFAULT_DRIVER_NAME
GPU_COUNT_LABEL = "nodesim.carve.dev/gpus"


@dataclass(frozen=True)
class SimNodeSpec:
    """A node to simulate: its GPUs by catalog key, and what its kubelet would report."""

    name: str
    gpus: tuple[str, ...]
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    labels: Mapping[str, str] = field(default_factory=dict)
    latency: str = "zero"  # simulator latency preset: "zero" or "realistic"
    # Positions in `gpus` of the GPUs whose MIG mode is off at first boot (as after an
    # operator's `nvidia-smi -mig 0`); the others start in MIG mode.
    mig_off: tuple[int, ...] = ()
    # Extra flags for this node's carve-kubelet-plugin (e.g. "--binding-conditions").
    plugin_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_gpu_keys(self.name, self.gpus)
        if self.latency not in ("zero", "realistic"):
            raise ValueError(f"node {self.name}: latency must be 'zero' or 'realistic'")
        bad = [i for i in self.mig_off if not 0 <= i < len(self.gpus)]
        if bad:
            raise ValueError(
                f"node {self.name}: mig_off names GPU position(s) {bad}, but the node has "
                f"{len(self.gpus)} GPU(s) (positions 0..{len(self.gpus) - 1})"
            )


def check_gpu_keys(node: str, gpus: tuple[str, ...]) -> None:
    """A node's GPUs must be catalog keys; the message lists them."""
    unknown = [g for g in gpus if g not in catalog.CATALOG]
    if unknown:
        raise ValueError(
            f"node {node}: unknown GPU model(s) {unknown}; catalog keys are "
            f"{', '.join(sorted(catalog.CATALOG))}"
        )


def write_sim_config(
    path: Path,
    node: str,
    gpus: tuple[str, ...],
    latency: str,
    mig_off: Collection[int] = (),
) -> None:
    """The NVML simulator config of one node (simulated or real): its GPUs by catalog key,
    those at the positions `mig_off` with MIG mode off."""
    data: dict[str, Any] = {
        "state": "sim/state.json",
        "uuid_seed": node,  # GPU UUIDs must differ between nodes
        "gpus": [{"model": g, "mig": False} if i in mig_off else g for i, g in enumerate(gpus)],
        "options": {"latency": latency, "ampere_reset": "auto"},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def read_hardware(sim_config: Path) -> dict[str, Any]:
    """The simulator's state for a node (GPUs, GPU and compute instances), read under the
    simulator's own lock so a half-written state is never seen."""
    from driver.nvml.sim.config import load_config_file
    from driver.nvml.sim.hardware import StateStore

    with StateStore(load_config_file(sim_config)).transaction() as state:
        return state.to_json()


def hardware_view(
    node: str, gpus: tuple[str, ...], sim_config: Path, checkpoint: Path | None = None
) -> NodeHardware:
    """A node's GPU instances as invariant-checker slots, with those its plugin keeps warm
    (from the plugin's `checkpoint` file, read before and after the hardware: an instance
    parked or reclaimed in between is warm in one of the two reads)."""
    models = [catalog.gpu_model(k) for k in gpus]
    before = _warm_slots(node, checkpoint)
    hw = node_hardware(node, models, read_hardware(sim_config))
    return replace(hw, warm=before | _warm_slots(node, checkpoint))


def _warm_slots(node: str, checkpoint: Path | None) -> frozenset[Slot]:
    from kubeletplugin.checkpoint import CheckpointError, CheckpointVersionError, decode

    if checkpoint is None:
        return frozenset()
    try:
        cp = decode(checkpoint.read_bytes())
    except (OSError, CheckpointError, CheckpointVersionError):
        return frozenset()  # none yet, or being replaced: only warm slices are lost to the view
    return frozenset(Slot(node, w.gpu_minor, w.profile_id, w.placement_start) for w in cp.warm)


def plugin_argv(
    *,
    node_name: str,
    driver: str,
    kubeconfig: Path,
    registry_dir: Path,
    plugins_dir: Path,
    cdi_dir: Path,
    sim_config: Path,
    http_address: str = "127.0.0.1:0",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The command line of carve's plugin on simulated GPUs, for simulated and real nodes alike
    (``extra`` flags come last, so they win)."""
    return [
        *console_script("carve-kubelet-plugin", "kubeletplugin.main"),
        f"--node-name={node_name}",
        f"--driver-name={driver}",
        f"--kubeconfig={kubeconfig}",
        f"--registry-dir={registry_dir}",
        f"--plugins-dir={plugins_dir}",
        f"--cdi-root={cdi_dir}",
        f"--simulate={sim_config}",
        f"--http-address={http_address}",
        "--resync-period=10s",
        "--log-format=text",
        *extra,
    ]


class SimNode:
    """Start with `start()`; `kill_plugin()` / `start_plugin()` model a crashing node agent."""

    def __init__(
        self,
        spec: SimNodeSpec,
        directory: Path,
        kubeconfig: Path,
        api_client: Any,
        heartbeater: NodeHeartbeater,
        *,
        detached: bool = False,
        driver: str = DRIVER,
    ) -> None:
        self.spec = spec
        self.driver = driver
        self.dir = directory  # short: unix socket paths below it must stay under 108 bytes
        self.kubeconfig = kubeconfig
        self._api_client = api_client
        self._heartbeater = heartbeater
        self._detached = detached
        self._plugin: ManagedProcess | None = None
        self.kubelet, self.agent = self._new_kubelet()

    def _new_kubelet(self) -> tuple[KubeletSim, NodeAgent]:
        kubelet = KubeletSim(self.registry_dir, timeout=45.0)
        agent = NodeAgent(
            self._api_client,
            kubelet,
            AgentSettings(
                node_name=self.spec.name,
                cdi_roots=(self.cdi_dir,),
                containers_dir=self.containers_dir,
            ),
        )
        return kubelet, agent

    # -- paths ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def sim_config(self) -> Path:
        return self.dir / "sim.yaml"

    @property
    def registry_dir(self) -> Path:
        return self.dir / "registry"

    @property
    def plugins_dir(self) -> Path:
        return self.dir / "plugins"

    @property
    def cdi_dir(self) -> Path:
        return self.dir / "cdi"

    @property
    def containers_dir(self) -> Path:
        return self.dir / "containers"

    @property
    def plugin_log(self) -> Path:
        return self.dir / "plugin.log"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SimNode:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_sim_config()
        self._heartbeater.add(self._fake_node())
        self.start_plugin()
        self.agent.start()
        self.wait_plugin_ready(timeout)
        return self

    def _fake_node(self) -> FakeNode:
        labels = {GPU_COUNT_LABEL: str(len(self.spec.gpus)), **self.spec.labels}
        return FakeNode(
            name=self.spec.name,
            cpu=self.spec.cpu,
            memory=self.spec.memory,
            pods=self.spec.pods,
            labels=labels,
        )

    def lose(self, *, delete: bool = True) -> None:
        """The machine dies: its kubelet side stops, its plugin is killed (SIGKILL, nothing
        cleaned up), its heartbeat stops and, with ``delete``, its Node object is removed (as
        a cloud provider or an admin does). Directory, simulated GPUs (with whatever instances
        they hold) and the plugin's checkpoint stay, for `come_back`."""
        self.agent.stop()
        self.kill_plugin()
        self.kubelet.close()
        self._heartbeater.forget(self.name)
        if delete:
            delete_node(self._api_client, self.name)

    def come_back(self, timeout: float = 60.0) -> None:
        """The same machine boots again after `lose`: same directory and GPU state, a fresh
        kubelet side, its Node object re-created if it was deleted (else heartbeated again),
        and its plugin started; returns once the kubelet side has registered the plugin."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        self.kubelet, self.agent = self._new_kubelet()
        try:
            existing = client.CoreV1Api(self._api_client).read_node(self.name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._heartbeater.add(self._fake_node())
        else:
            assert existing.metadata is not None
            self._heartbeater.adopt(self.name, str(existing.metadata.uid))
        self.start_plugin()
        self.agent.start()
        self.wait_plugin_ready(timeout)

    def _write_sim_config(self) -> None:
        write_sim_config(
            self.sim_config, self.spec.name, self.spec.gpus, self.spec.latency, self.spec.mig_off
        )

    def start_plugin(self) -> None:
        if self._plugin is not None and self._plugin.exit_code() is None:
            raise RuntimeError(f"node {self.name}: the plugin is already running")
        argv = plugin_argv(
            node_name=self.name,
            driver=self.driver,
            kubeconfig=self.kubeconfig,
            registry_dir=self.registry_dir,
            plugins_dir=self.plugins_dir,
            cdi_dir=self.cdi_dir,
            sim_config=self.sim_config,
            extra=self.spec.plugin_args,
        )
        self._plugin = ManagedProcess(
            f"carve-kubelet-plugin[{self.name}]",
            argv,
            self.plugin_log,
            tie_to_parent=not self._detached,
        )

    def kill_plugin(self, sig: int = signal.SIGKILL) -> None:
        """Kill the plugin process (SIGKILL by default: a crash, nothing cleaned up)."""
        if self._plugin is not None:
            self._plugin.kill(sig)

    def wait_plugin_ready(self, timeout: float = 60.0) -> None:
        """Until the kubelet side has registered the current plugin process."""
        deadline = time.monotonic() + timeout
        sock = self.registry_dir / f"{self.driver}-reg.sock"
        while True:
            if self._plugin is not None and self._plugin.exit_code() is not None:
                raise RuntimeError(
                    f"node {self.name}: carve-kubelet-plugin exited with "
                    f"{self._plugin.exit_code()}:\n{tail_of(self.plugin_log, 30)}"
                )
            plugin = self.kubelet.plugins.get(self.driver)
            identity = socket_identity(sock)
            if plugin is not None and identity is not None and plugin.socket_identity == identity:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"node {self.name}: plugin not registered within {timeout:.0f}s; log "
                    f"{self.plugin_log}:\n{tail_of(self.plugin_log, 30)}"
                )
            time.sleep(0.1)

    def stop(self, *, delete: bool = True) -> None:
        self.agent.stop()
        if self._plugin is not None:
            self._plugin.stop(grace_seconds=10.0)
        self.kubelet.close()
        if delete:
            self._heartbeater.forget(self.name)
            delete_node(self._api_client, self.name)

    # -- inspection ----------------------------------------------------------------------------

    def hardware(self) -> dict[str, Any]:
        return read_hardware(self.sim_config)

    def hardware_view(self) -> NodeHardware:
        checkpoint = self.plugins_dir / self.driver / "checkpoint.json"
        return hardware_view(self.name, self.spec.gpus, self.sim_config, checkpoint)

    def plugin_log_tail(self, lines: int = 40) -> str:
        return tail_of(self.plugin_log, lines)
