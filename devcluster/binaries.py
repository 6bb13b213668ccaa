"""Where the control-plane binaries come from: a per-version cache filled by hack/k8s/build.sh.

The build compiles Kubernetes from the Go module proxy (tens of minutes cold on two cores),
so it happens once per machine; every later cluster start only checks the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

K8S_VERSION = "v1.37.2"
REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "hack" / "k8s" / "build.sh"
# build.sh also builds dra-allocate (tests.support.real_allocator); `--check` covers it.
_NAMES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")


class BinariesUnavailableError(RuntimeError):
    """The control plane cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path

    @classmethod
    def in_directory(cls, directory: Path) -> Binaries:
        return cls(*(directory / name for name in _NAMES))

    def missing(self) -> list[Path]:
        return [
            p
            for p in (
                self.etcd,
                self.kube_apiserver,
                self.kube_scheduler,
                self.kube_controller_manager,
            )
            if not os.access(p, os.X_OK)
        ]


def cache_root() -> Path:
    configured = os.environ.get("CARVE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "carve"


def bin_dir() -> Path:
    """``$CARVE_K8S_BIN_DIR`` (prebuilt binaries) or the versioned build cache."""
    configured = os.environ.get("CARVE_K8S_BIN_DIR")
    return Path(configured) if configured else cache_root() / "k8s" / K8S_VERSION / "bin"


def go_toolchain() -> str | None:
    found = shutil.which("go")
    if found:
        return found
    fallback = Path("/usr/local/go/bin/go")
    return str(fallback) if os.access(fallback, os.X_OK) else None


def kubectl_path() -> Path | None:
    """The kubectl 1.37 that the ``dev`` extra installs next to this interpreter.

    The system kubectl may be older than the server and misread resource.k8s.io/v1."""
    candidates = [Path(sys.executable).parent / "kubectl", Path(sys.prefix) / "bin" / "kubectl"]
    configured = os.environ.get("CARVE_KUBECTL")
    if configured:
        candidates.insert(0, Path(configured))
    return next((p for p in candidates if os.access(p, os.X_OK)), None)


def ensure_binaries(
    *, build: bool = True, progress: Callable[[str], None] | None = None
) -> Binaries:
    """Return the cached binaries, building them first if needed and allowed.

    Raises BinariesUnavailableError with the reason when Go is missing, building is not
    allowed, or the build fails (the failing module or step is in the message)."""
    directory = bin_dir()
    binaries = Binaries.in_directory(directory)
    if "CARVE_K8S_BIN_DIR" in os.environ:
        if binaries.missing():
            raise BinariesUnavailableError(
                f"CARVE_K8S_BIN_DIR={directory} lacks {', '.join(map(str, binaries.missing()))}"
            )
        return binaries
    go = go_toolchain()
    if go is None:
        if not binaries.missing():
            return binaries  # built earlier; without Go the inputs cannot be re-checked
        raise BinariesUnavailableError(
            "Go (>= 1.26) is not installed, so the Kubernetes v1.37 control plane cannot be "
            f"built; install Go or set CARVE_K8S_BIN_DIR to prebuilt binaries ({', '.join(_NAMES)})"
        )
    env = dict(os.environ)
    env["PATH"] = f"{Path(go).parent}{os.pathsep}{env.get('PATH', '')}"
    check = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], env=env, capture_output=True, check=False
    )
    if check.returncode == 0:
        return binaries
    if not build:
        raise BinariesUnavailableError(
            f"control-plane binaries in {directory} are missing or stale; run `make k8s-bin`"
        )
    say = progress if progress is not None else _to_stderr
    say(f"building Kubernetes {K8S_VERSION} control plane (cold: ~6 minutes on 2 cores)")
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    for line in proc.stderr:
        lines.append(line)
        say(line.rstrip("\n"))
    if proc.wait() != 0:
        raise BinariesUnavailableError(
            "building the control plane failed (hack/k8s/build.sh):\n" + "".join(lines[-25:])
        )
    return binaries


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
