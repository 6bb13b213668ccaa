"""The NVIDIA driver's user-space files under a driver root: what a container needs besides nodes.

A container that gets a MIG slice through carve's CDI spec gets exactly what the spec names. Device
nodes alone are not enough: CUDA programs load ``libcuda.so.1`` and ``libnvidia-ml.so.1`` from the
*driver* (whose version must match the kernel module), and tools expect ``nvidia-smi`` and the MPS
binaries. The NVIDIA container toolkit injects these for its own runtime; carve's spec has to name
them itself, the same files the toolkit picks for the default capabilities (compute, utility):

- the driver libraries of the toolkit's utility and compute lists, each as ``<name>.<version>``
  in the usual library folders, the version being that of ``libcuda.so.<version>`` or
  ``libnvidia-ml.so.<version>`` (or the one NVML reports, when the caller passes it);
- the binaries ``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced``,
  ``nvidia-cuda-mps-control`` and ``nvidia-cuda-mps-server`` from the usual bin folders;
- the GSP firmware ``/lib/firmware/nvidia/<version>/gsp*.bin``;
- the IPC sockets of nvidia-persistenced and the fabric manager, and the MPS pipe folder
  ``/tmp/nvidia-mps``, each only when present.

Everything is looked up *inside* the driver root, which is ``/`` for a driver installed on the host
and ``/run/nvidia/driver`` with the GPU Operator's driver container. Symbolic links are followed as
they would be with the root as ``/`` (an absolute target starts again at the root), and a file is
mounted in the container at its path relative to the root: ``/run/nvidia/driver/usr/bin/nvidia-smi``
becomes ``/usr/bin/nvidia-smi``. Libraries are mounted by their versioned name, so the container
also needs the ``libcuda.so.1`` style links and an ld.so cache that lists the folders: when the
toolkit's hook binary (``nvidia-cdi-hook``, or ``nvidia-ctk hook``) is on the node, two
createContainer hooks do that (``create-symlinks``, ``update-ldcache``), with the arguments the
toolkit gives them. Without it the spec has no hooks (see ``DriverFiles.hook_binary``).

Only the file system is read here; nothing is written and no NVML call is made.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from driver.cdi import CREATE_CONTAINER, Hook, Mount, SpecEdits

DEFAULT_DRIVER_ROOT = Path("/")
GPU_OPERATOR_DRIVER_ROOT = Path("/run/nvidia/driver")

# The toolkit's "utility" and "compute" library lists (libnvidia-container), by their unversioned
# names: what a container gets with the default NVIDIA_DRIVER_CAPABILITIES (compute,utility).
UTILITY_LIBRARIES = ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so")
COMPUTE_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-fatbinaryloader.so",
    "libnvidia-allocator.so",
    "libnvidia-compiler.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so",
    "libnvidia-tileiras.so",
)
LIBRARIES = UTILITY_LIBRARIES + COMPUTE_LIBRARIES
NVML_LIBRARY = "libnvidia-ml.so"

# Where the toolkit looks for driver libraries when it does not use the ld.so cache.
LIBRARY_DIRS = (
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
    "/usr/lib",
    "/lib",
)

BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
# The toolkit's default PATH, searched inside the driver root.
BINARY_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")

FIRMWARE_DIR = "/lib/firmware/nvidia"  # /<version>/gsp*.bin
FIRMWARE_GLOB = "gsp*.bin"

# Sockets and the MPS pipe folder: clients write to them, so they are not read-only, but nothing
# on them is a device, a setuid binary or a program.
IPC_PATHS = (
    ("/run/nvidia-persistenced/socket", "/var/run/nvidia-persistenced/socket"),
    ("/run/nvidia-fabricmanager/socket", "/var/run/nvidia-fabricmanager/socket"),
    ("/tmp/nvidia-mps",),
)
IPC_OPTIONS = ("nosuid", "nodev", "bind", "noexec")

# The toolkit's hook binaries, preferred in this order. They run on the host (the runtime starts
# them), so a copy inside the driver root is looked for first (its path is a host path), then
# the places the toolkit and the GPU Operator install them.
HOOK_BINARIES = ("nvidia-cdi-hook", "nvidia-ctk")
HOOK_DIRS_IN_ROOT = ("/usr/bin", "/usr/local/bin")
HOST_HOOK_DIRS = (Path("/usr/local/nvidia/toolkit"), Path("/usr/bin"), Path("/usr/local/bin"))
CREATE_SYMLINKS = "create-symlinks"
UPDATE_LDCACHE = "update-ldcache"

_VERSION_RE = re.compile(r"^\d+(\.\d+)+$")
_MAX_LINKS = 40


class DriverRootError(Exception):
    """The driver root holds no usable driver; the message says what is missing and where."""


@dataclass(frozen=True)
class DriverFiles:
    """What a container needs from the driver under `root`, ready for a CDI spec.

    `mounts` are read-only bind mounts (IPC sockets: writable, no exec), container path = host
    path minus the root. `hooks` are empty when `hook_binary` is None (no toolkit on the node).
    """

    root: Path
    version: str
    mounts: tuple[Mount, ...]
    library_dirs: tuple[str, ...] = ()  # container paths of the folders holding the libraries
    hooks: tuple[Hook, ...] = ()
    hook_binary: str | None = None

    def spec_edits(self) -> SpecEdits:
        return SpecEdits(self.mounts, self.hooks)


def host_path(root: Path, path: str) -> str:
    """Where `path` (absolute, as seen with `root` as /) is on the host."""
    return path if root == Path("/") else str(root / path.lstrip("/"))


def resolve_in_root(root: Path, path: str) -> str | None:
    """`path` with every symbolic link followed as it would be with `root` as /.

    An absolute link target starts again at `root`, `..` never climbs above it. Returns the
    resulting absolute path (as seen with `root` as /), or None when a component is missing or
    the links loop.
    """
    pending = [p for p in PurePosixPath(path).parts if p != "/"]
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        on_host = root.joinpath(*done, part)
        try:
            mode = os.lstat(on_host).st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            links += 1
            if links > _MAX_LINKS:
                return None
            target = os.readlink(on_host)
            if target.startswith("/"):
                done = []
            pending = [p for p in PurePosixPath(target).parts if p != "/"] + pending
            continue
        done.append(part)
    return "/" + "/".join(done)


def _mode(root: Path, path: str) -> int | None:
    try:
        return os.stat(host_path(root, path)).st_mode
    except OSError:
        return None


def _is_file(root: Path, path: str) -> bool:
    mode = _mode(root, path)
    return mode is not None and stat.S_ISREG(mode)


def _is_dir(root: Path, path: str) -> bool:
    mode = _mode(root, path)
    return mode is not None and stat.S_ISDIR(mode)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _versions(root: Path, library: str) -> set[str]:
    """Every <version> for which <library>.<version> is a file in one of the library folders."""
    found: set[str] = set()
    prefix = library + "."
    for folder in LIBRARY_DIRS:
        real = resolve_in_root(root, folder)
        if real is None or not _is_dir(root, real):
            continue
        try:
            names = os.listdir(host_path(root, real))
        except OSError:
            continue
        for name in names:
            suffix = name[len(prefix) :]
            if name.startswith(prefix) and _VERSION_RE.match(suffix):
                located = resolve_in_root(root, f"{real}/{name}")
                if located is not None and _is_file(root, located):
                    found.add(suffix)
    return found


def infer_version(root: Path) -> str:
    """The driver version from libcuda.so.<version>, else libnvidia-ml.so.<version> (the newest
    when several are installed)."""
    for library in ("libcuda.so", NVML_LIBRARY):
        versions = _versions(root, library)
        if versions:
            return max(versions, key=_version_key)
    raise DriverRootError(
        f"no NVIDIA driver under driver root {root}: no libcuda.so.<version> or "
        f"{NVML_LIBRARY}.<version> in {', '.join(LIBRARY_DIRS)}"
    )


def nvml_library(root: Path) -> Path | None:
    """The host path of the driver root's ``libnvidia-ml.so.<version>`` (the newest), or None.

    The plugin's container has no driver of its own: NVML must come from the node's driver
    (its version matches the kernel module), so the plugin loads this file before pynvml
    looks for ``libnvidia-ml.so.1`` by name, and the loader hands pynvml the one loaded.
    """
    versions = _versions(root, NVML_LIBRARY)
    if not versions:
        return None
    version = max(versions, key=_version_key)
    for folder in LIBRARY_DIRS:
        real = resolve_in_root(root, folder)
        located = resolve_in_root(root, f"{real}/{NVML_LIBRARY}.{version}") if real else None
        if located is not None and _is_file(root, located):
            return Path(host_path(root, located))
    return None


def _libraries(root: Path, version: str) -> list[tuple[str, str]]:
    """(library name, resolved path) of every listed library of `version`; the first folder
    that has it wins."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name in LIBRARIES:
        for folder in LIBRARY_DIRS:
            real = resolve_in_root(root, f"{folder}/{name}.{version}")
            if real is not None and _is_file(root, real):
                if real not in seen:
                    seen.add(real)
                    found.append((name, real))
                break
    return found


def _binaries(root: Path) -> list[str]:
    found: list[str] = []
    for name in BINARIES:
        for folder in BINARY_DIRS:
            real = resolve_in_root(root, f"{folder}/{name}")
            mode = None if real is None else _mode(root, real)
            if real is not None and mode is not None and stat.S_ISREG(mode) and mode & 0o111:
                if real not in found:
                    found.append(real)
                break
    return found


def _firmware(root: Path, version: str) -> list[str]:
    real = resolve_in_root(root, f"{FIRMWARE_DIR}/{version}")
    if real is None or not _is_dir(root, real):
        return []
    found = []
    for entry in sorted(Path(host_path(root, real)).glob(FIRMWARE_GLOB)):
        located = resolve_in_root(root, f"{real}/{entry.name}")
        if located is not None and _is_file(root, located):
            found.append(located)
    return found


def _ipc(root: Path) -> list[str]:
    found = []
    for alternatives in IPC_PATHS:
        for path in alternatives:
            real = resolve_in_root(root, path)
            if real is not None and _mode(root, real) is not None:
                found.append(real)
                break
    return found


def find_hook_binary(root: Path, host_dirs: Sequence[Path]) -> str | None:
    """The host path of the toolkit's hook binary: in the driver root first, then `host_dirs`."""
    for name in HOOK_BINARIES:
        places = [Path(host_path(root, d)) for d in HOOK_DIRS_IN_ROOT] + list(host_dirs)
        for folder in places:
            candidate = folder / name
            try:
                mode = os.stat(candidate).st_mode
            except OSError:
                continue
            if stat.S_ISREG(mode) and mode & 0o111:
                return str(candidate)
    return None


def hook_args(binary: str, hook: str, *args: str) -> tuple[str, ...]:
    """argv of one toolkit hook: `nvidia-cdi-hook <hook> ...` or `nvidia-ctk hook <hook> ...`."""
    base = os.path.basename(binary)
    return (base, "hook", hook, *args) if base == "nvidia-ctk" else (base, hook, *args)


def library_links(root: Path, libraries: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(target, link) pairs the container needs beside the versioned libraries.

    Every symbolic link next to a library that leads to it (``libcuda.so.1``, ``libcuda.so``) is
    recreated with the same target text, and ``libcuda.so -> libcuda.so.1`` always exists,
    because programs dlopen it although it is only a development link.
    """
    links: dict[str, str] = {}
    for name, real in libraries:
        folder = str(PurePosixPath(real).parent)
        try:
            entries = sorted(os.scandir(host_path(root, folder)), key=lambda e: e.name)
        except OSError:
            entries = []
        for entry in entries:
            if not entry.name.startswith(name) or not entry.is_symlink():
                continue
            link = f"{folder}/{entry.name}"
            if resolve_in_root(root, link) == real:
                links.setdefault(link, os.readlink(entry.path))
        if name == "libcuda.so":
            links.setdefault(f"{folder}/libcuda.so", "libcuda.so.1")
    return [(target, link) for link, target in links.items()]


def _hooks(binary: str, links: Sequence[tuple[str, str]], folders: Sequence[str]) -> list[Hook]:
    hooks = []
    if links:
        pairs = [a for target, link in links for a in ("--link", f"{target}::{link}")]
        hooks.append(Hook(binary, hook_args(binary, CREATE_SYMLINKS, *pairs), CREATE_CONTAINER))
    if folders:
        args = [a for f in folders for a in ("--folder", f)]
        hooks.append(Hook(binary, hook_args(binary, UPDATE_LDCACHE, *args), CREATE_CONTAINER))
    return hooks


def discover(
    root: Path,
    *,
    version: str | None = None,
    hook_dirs: Sequence[Path] | None = None,
) -> DriverFiles:
    """The driver files under `root` (see the module docstring).

    `version` is the driver version NVML reports; without it the version is read from the
    libraries' names. `hook_dirs` are the host folders searched for the hook binary after the
    driver root (default HOST_HOOK_DIRS). Raises DriverRootError when the root is missing or
    holds no libnvidia-ml.so of that version (no driver: a container could not even run
    nvidia-smi).
    """
    root = Path(os.path.abspath(root))
    if not root.is_dir():
        raise DriverRootError(f"driver root {root} does not exist or is not a directory")
    version = version or infer_version(root)
    libraries = _libraries(root, version)
    if not any(name == NVML_LIBRARY for name, _ in libraries):
        raise DriverRootError(
            f"no NVIDIA driver {version} under driver root {root}: "
            f"{NVML_LIBRARY}.{version} is in none of {', '.join(LIBRARY_DIRS)}"
        )
    mounts = [Mount(host_path(root, p), p) for _, p in libraries]
    mounts += [Mount(host_path(root, p), p) for p in _binaries(root)]
    mounts += [Mount(host_path(root, p), p) for p in _firmware(root, version)]
    mounts += [Mount(host_path(root, p), p, IPC_OPTIONS) for p in _ipc(root)]
    folders = tuple(dict.fromkeys(str(PurePosixPath(p).parent) for _, p in libraries))
    binary = find_hook_binary(root, HOST_HOOK_DIRS if hook_dirs is None else hook_dirs)
    hooks = () if binary is None else tuple(_hooks(binary, library_links(root, libraries), folders))
    return DriverFiles(
        root=root,
        version=version,
        mounts=tuple(mounts),
        library_dirs=folders,
        hooks=hooks,
        hook_binary=binary,
    )
