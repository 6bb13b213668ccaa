"""The simulated node's files: a fake driver root and a dev root with the NVIDIA device nodes.

On a real node the driver's user-space files (libcuda, libnvidia-ml, nvidia-smi, firmware) live
under a driver root and the kernel module's device nodes under /dev. The plugin hands both to
containers through its CDI specs (``driver.driverroot``). So that the very same plugin code runs
here without a GPU, the simulator can stand in for both, in two directories of the caller's
choice (never the real / or /dev):

- the driver root gets placeholder libraries named with the driver version the simulator reports
  (``libnvidia-ml.so.<version>``, ``libcuda.so.<version>``, their ``.so.1`` links), a GSP
  firmware file, and ``usr/bin/nvidia-smi``: a POSIX sh script (busybox is enough) that answers
  ``nvidia-smi -L`` like the real one for the devices the container's ``NVIDIA_VISIBLE_DEVICES``
  names. The script carries the node's GPUs and MIG devices in a table at its end, which is
  rewritten *in place* whenever an instance is created or destroyed, so the file's inode never
  changes after it was first written. A container's bind mount holds that inode, and the
  stand-in answers from the node's current state as the real one asks the driver: nothing
  simulator-specific is needed in the CDI code, which mounts ``usr/bin/nvidia-smi`` like any
  driver binary. (Replacing the file instead, new file then rename, raced with the container
  runtime: runc opens a bind mount's source and then checks its path, and refuses a source
  that was replaced in between with "possibly malicious path detected ... (deleted)".) The
  script reads its table twice until two complete reads agree, so a read that overlaps a
  rewrite is never used.
- the driver root also gets ``usr/bin/nvidia-cuda-mps-control``, a stand-in for the MPS control
  daemon and its client that speaks the real one's control protocol (``mpscontrol``).
- the dev root gets ``dev/nvidiactl``, ``dev/nvidia<minor>``, ``dev/nvidia-uvm(-tools)`` and
  ``dev/nvidia-caps/nvidia-cap<N>`` for every live GPU and compute instance (removed with it),
  with the majors of the simulator's /proc/devices. Creating device nodes needs root; otherwise
  this is logged once and skipped.

The functions here take plain data; ``hardware.sync_node_files`` feeds them from the state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import stat
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.nvml.sim.config import SimConfigError
from driver.nvml.sim.mpscontrol import MPS_CONTROL, mps_control_script

log = logging.getLogger("driver.nvml.sim")

MARKER = "carve NVML simulator placeholder"
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
GPU_NODE_MODE = 0o666
CAP_NODE_MODE = 0o444
# nvidia-cap1 is mig/config (root only), nvidia-cap2 mig/monitor; both exist once MIG is in use.
STATIC_CAPS = {1: 0o400, 2: 0o444}
FIRMWARE_FILE = "gsp_ga10x.bin"
NVIDIA_SMI = "usr/bin/nvidia-smi"

_SAFE = re.compile(r"^[A-Za-z0-9 ._+:()/-]+$")
_CAP_RE = re.compile(r"^nvidia-cap(\d+)$")
_GPU_RE = re.compile(r"^nvidia(\d+)$")
_warned: set[str] = set()  # dev roots already reported as left without nodes (log once)


@dataclass(frozen=True)
class SmiMig:
    profile: str  # as nvidia-smi names it: "1g.10gb", or "1c.2g.20gb" for a smaller CI
    uuid: str
    cap_minor: int = -1  # its compute instance's nvidia-caps access node; -1: unknown


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as ``nvidia-smi -L`` shows it, in NVML index order, with its MIG devices."""

    uuid: str
    name: str
    migs: tuple[SmiMig, ...] = ()
    minor: int = -1  # /dev/nvidia<minor>; -1: unknown


def library_dir() -> str:
    """The Debian-style multiarch folder for this machine (where a driver package puts libs)."""
    arch = "aarch64" if platform.machine() in ("aarch64", "arm64") else "x86_64"
    return f"usr/lib/{arch}-linux-gnu"


def cuda_version_text(cuda_driver_version: int) -> str:
    """NVML's 13000 as nvidia-smi prints it: 13.0."""
    return f"{cuda_driver_version // 1000}.{cuda_driver_version % 1000 // 10}"


# --- the nvidia-smi stand-in ---------------------------------------------------------------------

_SCRIPT = r"""#!/bin/sh
# @@MARKER@@: nvidia-smi stand-in.
#
# Written by carve's NVML simulator (driver/nvml/sim/driverfiles.py). The device table at the end
# is rewritten in place whenever a GPU or compute instance is created or destroyed (the file is
# never replaced, so a container's bind mount shows the current one). Simulated: -L/--list-gpus,
# --version, and the header of a
# bare `nvidia-smi`. Inside a container (where /dev/nvidiactl exists) the devices shown are those
# whose device nodes the container has, as the real driver decides: a GPU by /dev/nvidia<minor>,
# a MIG device by its compute instance's /dev/nvidia-caps/nvidia-cap<N>. Elsewhere they are those
# NVIDIA_VISIBLE_DEVICES names (GPU or MIG UUIDs or GPU indices, comma separated; all, none,
# void). Either way numbered as a container sees them. POSIX sh only: it runs inside busybox.

DRIVER_VERSION='@@VERSION@@'
CUDA_VERSION='@@CUDA@@'
DEV=${CARVE_SIM_DEV_DIR:-/dev}

load_table() {
    # The table's rows: G <NVML index> <minor> <GPU UUID> <name>
    #                   M <NVML index of its GPU> <cap minor> <profile> <MIG UUID>
    # A read that overlaps a rewrite may be torn; two equal complete reads are not.
    last=
    tries=0
    while [ "$tries" -lt 100 ]; do
        now=$(sed -n '/^#@@ TABLE$/,/^#@@ END$/p' "$0") || break
        case $now in
        *'#@@ END')
            if [ "$now" = "$last" ]; then
                TABLE=$(printf '%s\n' "$now" | sed -e '1d' -e '$d' -e 's/^#//')
                return 0
            fi
            ;;
        esac
        last=$now
        tries=$((tries + 1))
    done
    echo "nvidia-smi (carve NVML simulator): cannot read the device table from $0" >&2
    exit 9
}

in_list() {
    # in_list ",a,b," word...: is any word an element of the list?
    list=$1
    shift
    for word in "$@"; do
        case $list in *,"$word",*) return 0 ;; esac
    done
    return 1
}

list_gpus() {
    by_nodes=
    [ -e "$DEV/nvidiactl" ] && by_nodes=1
    visible=${NVIDIA_VISIBLE_DEVICES-all}
    case $visible in
    '' | none | void)
        if [ -z "$by_nodes" ]; then
            echo "No devices were found"
            return 6
        fi
        ;;
    esac
    visible=",$visible,"
    shown=0
    while read -r kind index minor uuid name; do
        [ "$kind" = G ] || continue
        whole=
        gpu_node=
        if [ -n "$by_nodes" ]; then
            [ -e "$DEV/nvidia$minor" ] && gpu_node=1
        elif [ "$visible" = ",all," ] || in_list "$visible" "$uuid" "$index"; then
            whole=1
        fi
        migs=
        count=0
        while read -r mkind parent cap profile mig; do
            [ "$mkind" = M ] && [ "$parent" = "$index" ] || continue
            if [ -n "$by_nodes" ]; then
                [ -n "$gpu_node" ] && [ -e "$DEV/nvidia-caps/nvidia-cap$cap" ] || continue
                migs="$migs$(printf '  MIG %-12sDevice %2d: (UUID: %s)' "$profile" "$count" "$mig")
"
                count=$((count + 1))
            elif [ -n "$whole" ] || in_list "$visible" "$mig"; then
                migs="$migs$(printf '  MIG %-12sDevice %2d: (UUID: %s)' "$profile" "$count" "$mig")
"
                count=$((count + 1))
            fi
        done <<EOF
$TABLE
EOF
        if [ -n "$whole" ] || [ -n "$gpu_node" ] || [ "$count" -gt 0 ]; then
            printf 'GPU %d: %s (UUID: %s)\n%s' "$shown" "$name" "$uuid" "$migs"
            shown=$((shown + 1))
        fi
    done <<EOF
$TABLE
EOF
    if [ "$shown" -eq 0 ]; then
        echo "No devices were found"
        return 6
    fi
    return 0
}

load_table
case ${1-} in
-L | --list-gpus)
    list_gpus
    exit $?
    ;;
--version)
    printf 'NVIDIA-SMI version  : %s\nDRIVER version      : %s\nCUDA Version        : %s\n' \
        "$DRIVER_VERSION" "$DRIVER_VERSION" "$CUDA_VERSION"
    ;;
'')
    printf 'NVIDIA-SMI %s    Driver Version: %s    CUDA Version: %s\n' \
        "$DRIVER_VERSION" "$DRIVER_VERSION" "$CUDA_VERSION"
    list_gpus
    exit $?
    ;;
*)
    echo "nvidia-smi (carve NVML simulator): only -L, --list-gpus and --version are simulated" >&2
    exit 2
    ;;
esac
exit 0
"""
_TABLE_BEGIN = "#@@ TABLE\n"
_TABLE_END = "#@@ END\n"


def _safe(text: str) -> str:
    if not _SAFE.match(text):
        raise SimConfigError(f"cannot put {text!r} into the nvidia-smi stand-in")
    return text


def nvidia_smi_script(version: str, cuda_version: str, gpus: Sequence[SmiGpu]) -> str:
    """The stand-in's text for a node with `gpus` (NVML index order)."""
    rows = []
    for index, gpu in enumerate(gpus):
        rows.append(f"G {index} {gpu.minor} {_safe(gpu.uuid)} {_safe(gpu.name)}")
        rows.extend(f"M {index} {m.cap_minor} {_safe(m.profile)} {_safe(m.uuid)}" for m in gpu.migs)
    body = (
        _SCRIPT.replace("@@MARKER@@", MARKER)
        .replace("@@VERSION@@", _safe(version))
        .replace("@@CUDA@@", _safe(cuda_version))
    )
    return body + _TABLE_BEGIN + "".join(f"#{row}\n" for row in rows) + _TABLE_END


# --- writing files that are ours ------------------------------------------------------------------


def _ours(path: Path) -> bool:
    """True for a regular file this module wrote (it carries the marker near the start)."""
    try:
        with open(path, "rb") as f:
            return MARKER.encode() in f.read(256)
    except OSError:
        return False


def _claim(path: Path, root: Path) -> None:
    """Refuse to overwrite a file the simulator did not write: `root` may be a real driver root."""
    if path.is_symlink() or not path.exists():
        return
    if not path.is_file() or not _ours(path):
        raise SimConfigError(
            f"{path} was not written by the NVML simulator, so {root} looks like a real driver "
            "root; give the simulator a directory of its own"
        )


def _write_if_changed(path: Path, text: str, mode: int) -> bool:
    """Atomically replace `path` with `text` (new file, then rename) unless it already holds it."""
    data = text.encode()
    try:
        if path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return True


def _symlink(link: Path, target: str) -> None:
    with contextlib.suppress(OSError):
        if os.readlink(link) == target:
            return
    tmp = link.with_name(f".{link.name}.link")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def populate_driver_root(root: Path, version: str) -> None:
    """The static part of the fake driver root (idempotent): libraries, links and firmware of
    `version`; placeholders of other versions the simulator wrote before are removed."""
    if root.resolve() == Path("/"):
        raise SimConfigError("the NVML simulator never writes into the real driver root /")
    libdir = root / library_dir()
    for lib in ("libnvidia-ml.so", "libcuda.so"):
        versioned = libdir / f"{lib}.{version}"
        _claim(versioned, root)
        _write_if_changed(versioned, f"{MARKER}: {lib}.{version}\n", 0o644)
        _symlink(libdir / f"{lib}.1", versioned.name)
        for old in libdir.glob(f"{lib}.*.*"):
            if old.name != versioned.name and not old.is_symlink() and _ours(old):
                old.unlink()
    firmware = root / "lib" / "firmware" / "nvidia" / version / FIRMWARE_FILE
    _claim(firmware, root)
    _write_if_changed(firmware, f"{MARKER}: GSP firmware {version}\n", 0o644)
    _claim(root / NVIDIA_SMI, root)
    _claim(root / MPS_CONTROL, root)
    _write_if_changed(root / MPS_CONTROL, mps_control_script(MARKER), 0o755)


def write_nvidia_smi(root: Path, script: str) -> bool:
    """Install the stand-in; True if its text changed.

    A file that already holds the same script body gets only its table rewritten, in place
    (see the module's docstring for why the inode must stay); anything else (no file yet, a new
    driver version) is replaced whole, which happens when the node is provisioned, before any
    container mounts it."""
    target = root / NVIDIA_SMI
    _claim(target, root)
    cut = script.index(_TABLE_BEGIN)
    body, table = script[:cut].encode(), script[cut:].encode()
    try:  # never through a link: that is replaced by a file of ours
        f = os.fdopen(os.open(target, os.O_RDWR | os.O_NOFOLLOW), "r+b")
    except OSError:
        return _write_if_changed(target, script, 0o755)
    with f:
        current = f.read()
        if current == body + table:
            return False
        in_place = current.startswith(body) and stat.S_IMODE(os.fstat(f.fileno()).st_mode) == 0o755
        if in_place:
            # One write, then cut what an old, longer table left behind its end marker.
            os.pwrite(f.fileno(), table, len(body))
            os.ftruncate(f.fileno(), len(body) + len(table))
            return True
    return _write_if_changed(target, script, 0o755)


# --- device nodes --------------------------------------------------------------------------------


def _warn_no_mknod(dev_root: Path, why: str) -> None:
    if str(dev_root) not in _warned:
        _warned.add(str(dev_root))
        log.warning(
            "simulated device nodes not created",
            extra={"devRoot": str(dev_root), "reason": why},
        )


def _node(path: Path, major: int, minor: int, mode: int) -> None:
    want = os.makedev(major, minor)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
        return
    if st is not None:
        path.unlink()
    os.mknod(path, stat.S_IFCHR | mode, want)
    os.chmod(path, mode)  # mknod's mode is filtered by the umask


def sync_dev_nodes(
    dev_root: Path,
    *,
    gpu_minors: Iterable[int],
    cap_minors: Iterable[int],
    caps_major: int,
    uvm_major: int,
) -> None:
    """Make ``<dev_root>/dev`` hold exactly the NVIDIA nodes of the simulated node now."""
    if dev_root.resolve() == Path("/"):
        raise SimConfigError("the NVML simulator never creates nodes in the real /dev")
    if os.geteuid() != 0:
        _warn_no_mknod(dev_root, "not running as root")
        return
    dev = dev_root / "dev"
    caps = dev / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    gpus = set(gpu_minors)
    wanted_caps = {m: CAP_NODE_MODE for m in cap_minors} | STATIC_CAPS
    try:
        _node(dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR, GPU_NODE_MODE)
        for minor in sorted(gpus):
            _node(dev / f"nvidia{minor}", NVIDIA_MAJOR, minor, GPU_NODE_MODE)
        _node(dev / "nvidia-uvm", uvm_major, 0, GPU_NODE_MODE)
        _node(dev / "nvidia-uvm-tools", uvm_major, 1, GPU_NODE_MODE)
        for minor, mode in sorted(wanted_caps.items()):
            _node(caps / f"nvidia-cap{minor}", caps_major, minor, mode)
    except PermissionError as exc:  # root without CAP_MKNOD (an unprivileged container)
        _warn_no_mknod(dev_root, str(exc))
        return
    for entry in caps.iterdir():
        m = _CAP_RE.match(entry.name)
        if m and int(m.group(1)) not in wanted_caps:
            entry.unlink()
    for entry in dev.iterdir():
        m = _GPU_RE.match(entry.name)
        if m and int(m.group(1)) not in gpus:
            entry.unlink()
