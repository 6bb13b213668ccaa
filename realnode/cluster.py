"""Several real nodes on one machine, joined to one control plane (test and demo tooling).

``RealNodes`` hands out node numbers (which pick bridges and pod subnets), kubelet ports and
short directories, builds the local images once, and starts a reaper so that a SIGKILLed
owner still leaves no container, mount or cgroup behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driver.contract import DEFAULT_DRIVER_NAME
from realnode import cleanup, images, reaper
from realnode.binaries import NodeBinaries, ensure_node_binaries
from realnode.layout import NodeLayout, node_ip
from realnode.node import RealNode, RealNodeSpec, free_ports

_log = logging.getLogger(__name__)

# Unix socket paths are limited to 107 bytes: node roots must stay short.
_ROOT_PREFIX = "carve-rn-"


class RealNodes:
    """The real nodes of one cluster. ``detached`` nodes outlive this process (the demo)."""

    def __init__(
        self,
        kubeconfig: Path,
        api_client: Any,
        *,
        root: Path | None = None,
        detached: bool = False,
        driver: str = DEFAULT_DRIVER_NAME,
        binaries: NodeBinaries | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.api_client = api_client
        self.driver = driver
        self.detached = detached
        self.binaries = binaries or ensure_node_binaries()
        self.root = root or Path(tempfile.mkdtemp(prefix=_ROOT_PREFIX, dir="/tmp"))
        self.root.mkdir(parents=True, exist_ok=True)
        reaper.record_owner(self.root, os.getpid())
        self.archives = images.build_archives(self.binaries.node_bin_dir, images.default_cache())
        self.nodes: dict[str, RealNode] = {}
        self._next_index = 1
        self._reaper: subprocess.Popen[bytes] | None = None
        if not detached:
            self._reaper = reaper.spawn(os.getpid(), self.root)

    def add_node(
        self,
        spec: RealNodeSpec,
        *,
        plugin_args: Sequence[str] = (),
        host_plugin: bool = True,
        extra_images: Sequence[images.ImageArchive] = (),
    ) -> RealNode:
        """Start a node; ``extra_images`` are imported besides the pause and test images, and
        without ``host_plugin`` carve's plugin is left to run in a container (RealNode.start)."""
        index = self._claim_index()
        port, healthz = free_ports(2)
        layout = NodeLayout(
            name=spec.name,
            index=index,
            root=self.root / f"n{index}",
            kubelet_port=port,
            kubelet_healthz_port=healthz,
        )
        node = RealNode(
            spec,
            layout,
            self.binaries,
            self.kubeconfig,
            self.api_client,
            detached=self.detached,
            driver=self.driver,
            plugin_args=plugin_args,
        )
        try:
            node.start([*self.archives, *extra_images], host_plugin=host_plugin)
        except BaseException:
            tails = node.log_tails()
            with contextlib.suppress(Exception):
                node.stop()
            _log.error("node %s failed to start:\n%s", spec.name, tails)
            raise
        self.nodes[spec.name] = node
        return node

    def _claim_index(self) -> int:
        """The lowest node number no node on this machine holds (its IP is the lock)."""
        for index in range(self._next_index, 250):
            if cleanup.claim_node_ip(node_ip(index)):
                self._next_index = index + 1
                return index
        raise RuntimeError("no free node number: 10.200.0.1-249 are all on lo")

    def remove_node(self, name: str) -> list[str]:
        return self.nodes.pop(name).stop()

    def stop(self) -> list[str]:
        done: list[str] = []
        for name in list(self.nodes):
            try:
                done += self.remove_node(name)
            except Exception:
                _log.exception("stopping real node %s failed", name)
        done += reaper.clean_root(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)
        return done
