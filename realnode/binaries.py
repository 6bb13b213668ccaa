"""The programs a real node runs, and whether this machine can run one at all.

kubelet comes from the control plane's build (hack/k8s/build.sh), containerd, its runc shim,
ctr and the pause program from hack/node/build.sh, runc and the CNI plugins from Debian's
packages (installed by hack/node/build.sh). ``why_not_here`` says, in one sentence, what is
missing, so that the demo can fall back to simulated nodes and the tests can fail with a reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from devcluster import binaries as control_plane

BUILD_SCRIPT = control_plane.REPO_ROOT / "hack" / "node" / "build.sh"
_CNI_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
_CNI_PLUGINS = ("bridge", "host-local", "loopback")


class NodeBinariesUnavailableError(RuntimeError):
    """A real node cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class NodeBinaries:
    kubelet: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    pause: Path
    runc: Path
    cni_bin_dir: Path

    @property
    def node_bin_dir(self) -> Path:
        return self.containerd.parent

    def missing(self) -> list[Path]:
        programs = (self.kubelet, self.containerd, self.containerd_shim, self.ctr, self.pause)
        gone = [p for p in (*programs, self.runc) if not os.access(p, os.X_OK)]
        gone += [self.cni_bin_dir / p for p in _CNI_PLUGINS if not (self.cni_bin_dir / p).exists()]
        return gone


def why_not_here() -> str | None:
    """None if a real kubelet and containerd can run on this machine, else the reason."""
    if not sys.platform.startswith("linux"):
        return f"real nodes need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "real nodes need root (containerd mounts overlayfs, the kubelet manages cgroups)"
    if not Path("/proc/filesystems").read_text().count("overlay"):
        return "the kernel has no overlayfs (containerd's snapshotter needs it)"
    return None


def ensure_node_binaries() -> NodeBinaries:
    """The node programs, built or installed first where anything is missing (a cached
    build answers in well under a second)."""
    reason = why_not_here()
    if reason is not None:
        raise NodeBinariesUnavailableError(reason)
    node_bin = _node_bin_dir()
    found = NodeBinaries(
        kubelet=control_plane.bin_dir() / "kubelet",
        containerd=node_bin / "containerd",
        containerd_shim=node_bin / "containerd-shim-runc-v2",
        ctr=node_bin / "ctr",
        pause=node_bin / "pause",
        runc=Path(shutil.which("runc") or "/usr/sbin/runc"),
        cni_bin_dir=next((d for d in _CNI_DIRS if (d / "bridge").exists()), _CNI_DIRS[0]),
    )
    missing = found.missing()
    if missing:
        raise NodeBinariesUnavailableError(
            "real-node programs missing: "
            + ", ".join(str(p) for p in missing)
            + " (run `make node-bin k8s-bin` as root)"
        )
    return found


def _node_bin_dir() -> Path:
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise NodeBinariesUnavailableError(
            f"hack/node/build.sh failed with exit code {done.returncode} (its output is above)"
        )
    return Path(done.stdout.strip().splitlines()[-1])
