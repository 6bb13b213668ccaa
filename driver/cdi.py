"""CDI (Container Device Interface) specs for prepared claims.

The container runtime, not carve, turns a CDI device ID into device nodes and environment in the
container. carve therefore writes one *transient* spec per claim when the claim is prepared and
removes it on unprepare. Every device node is fully specified (type, major, minor, mode): a MIG
slice needs nvidia-caps nodes that often do not exist on the host, and the runtime only skips its
`stat` of the host path for entries that carry a type and a non-zero major.

Besides the devices, a spec carries what every container of the claim needs from the driver: its
user-space files as read-only bind mounts and the toolkit's hooks (see `driver.driverroot`). Those
sit in the *spec-level* containerEdits, not in each device: a runtime applies a spec's own edits
once for every container that gets any of its devices, so a claim with four slices mounts
libcuda once instead of four times, and a device's edits stay exactly what sets it apart (its
nodes and its environment).

Writes are atomic (temporary file, fsync, rename, fsync of the directory) so a crash never leaves
a half-written spec that the runtime would reject or, worse, half-apply.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from driver.contract import DEFAULT_DRIVER_NAME
from driver.devnodes import (
    NVIDIA_MAJOR,
    NVIDIA_UVM_PATH,
    NVIDIA_UVM_TOOLS_PATH,
    NVIDIACTL_MINOR,
    NVIDIACTL_PATH,
    cap_device_path,
    gpu_device_path,
)

DEFAULT_CDI_ROOT = Path("/var/run/cdi")
DEFAULT_CLASS = "claim"

# Modes the nvidia driver gives its nodes: the GPU and control nodes are world read-write, the
# per-instance capability nodes read-only (DeviceFileMode 0444 in the proc access files).
GPU_NODE_MODE = 0o666
CAP_NODE_MODE = 0o444

_KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_VENDOR_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_CLASS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

# A bind mount of a driver file: read-only, and nothing on it may act as a device or setuid binary.
READ_ONLY_BIND = ("ro", "nosuid", "nodev", "bind")
# The OCI lifecycle points a CDI hook may name; the toolkit's hooks run at createContainer (in the
# container's mount namespace, before pivot_root), which is when the mounts are in place.
HOOK_NAMES = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)
CREATE_CONTAINER = "createContainer"


class CdiError(ValueError):
    """A spec or a CDI device ID that the container runtime would reject."""


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


@dataclass(frozen=True)
class DeviceNode:
    """A character device node created in the container by the runtime."""

    path: str
    major: int
    minor: int
    file_mode: int
    type: str = "c"
    # Where the node is on the host when that is not `path` (a per-node dev root); runtimes that
    # stat or bind-mount the host node use it. Empty: the same as `path`.
    host_path: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        if self.host_path and self.host_path != self.path:
            out["hostPath"] = self.host_path
        out.update(type=self.type, major=self.major, minor=self.minor, fileMode=self.file_mode)
        return out

    def under(self, dev_root: Path) -> DeviceNode:
        """This node as found under `dev_root` on the host (unchanged for the root itself)."""
        host = dev_root_path(dev_root, self.path)
        return replace(self, host_path="" if host == self.path else host)


def dev_root_path(dev_root: Path, path: str) -> str:
    """`path` (absolute, as the container sees it) under the host directory `dev_root`."""
    return str(dev_root / path.lstrip("/")) if dev_root != Path("/") else path


@dataclass(frozen=True)
class Mount:
    """A bind mount of a host file into the container (CDI containerEdits.mounts)."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = READ_ONLY_BIND

    def to_json(self) -> dict[str, Any]:
        return {
            "hostPath": self.host_path,
            "containerPath": self.container_path,
            "options": list(self.options),
        }


@dataclass(frozen=True)
class Hook:
    """An OCI hook the runtime runs for the container (CDI containerEdits.hooks).

    `path` is on the host (the runtime executes it); `args` start with argv[0], as OCI wants.
    """

    path: str
    args: tuple[str, ...]
    hook_name: str = CREATE_CONTAINER
    env: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hookName": self.hook_name,
            "path": self.path,
            "args": list(self.args),
        }
        if self.env:
            out["env"] = list(self.env)
        return out


@dataclass(frozen=True)
class SpecEdits:
    """Edits for a whole spec, applied once per container that gets any device of the spec."""

    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.mounts or self.hooks)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.mounts:
            out["mounts"] = [m.to_json() for m in self.mounts]
        if self.hooks:
            out["hooks"] = [h.to_json() for h in self.hooks]
        return out


@dataclass(frozen=True)
class CdiDevice:
    """One device of a claim's spec: what a container gets for one allocated device.

    `name` is the canonical device name from the ResourceSlice (e.g. `gpu-0-mig-1g10gb-19-0`);
    the spec prefixes it with the claim UID so that two claims never collide.
    """

    name: str
    device_nodes: tuple[DeviceNode, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def mig_device_nodes(
    *, gpu_minor: int, caps_major: int, gi_cap_minor: int, ci_cap_minor: int
) -> tuple[DeviceNode, ...]:
    """The nodes a container needs to use exactly one MIG slice of GPU `gpu_minor`.

    CUDA enumerates only the MIG device whose GI and CI capability nodes it can open, so handing
    over these two cap nodes (plus the parent GPU and the control node) is what isolates the slice.
    """
    return (
        DeviceNode(gpu_device_path(gpu_minor), NVIDIA_MAJOR, gpu_minor, GPU_NODE_MODE),
        DeviceNode(cap_device_path(gi_cap_minor), caps_major, gi_cap_minor, CAP_NODE_MODE),
        DeviceNode(cap_device_path(ci_cap_minor), caps_major, ci_cap_minor, CAP_NODE_MODE),
        DeviceNode(NVIDIACTL_PATH, NVIDIA_MAJOR, NVIDIACTL_MINOR, GPU_NODE_MODE),
    )


def uvm_device_nodes(*, uvm_major: int) -> tuple[DeviceNode, ...]:
    """The unified-memory nodes CUDA opens in every process (dynamic major, minors 0 and 1)."""
    return (
        DeviceNode(NVIDIA_UVM_PATH, uvm_major, 0, GPU_NODE_MODE),
        DeviceNode(NVIDIA_UVM_TOOLS_PATH, uvm_major, 1, GPU_NODE_MODE),
    )


def whole_gpu_device_nodes(*, gpu_minor: int) -> tuple[DeviceNode, ...]:
    return (
        DeviceNode(gpu_device_path(gpu_minor), NVIDIA_MAJOR, gpu_minor, GPU_NODE_MODE),
        DeviceNode(NVIDIACTL_PATH, NVIDIA_MAJOR, NVIDIACTL_MINOR, GPU_NODE_MODE),
    )


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that accepts `spec`'s content (the rules of CDI's version.go).

    Declaring the minimum rather than the newest keeps older runtimes able to load the spec.
    """
    required = "0.3.0"

    def need(version: str) -> None:
        nonlocal required
        if _version_key(version) > _version_key(required):
            required = version

    kind = str(spec.get("kind", ""))
    if "." in kind.partition("/")[2]:
        need("0.6.0")
    if spec.get("annotations"):
        need("0.6.0")
    edits: list[Mapping[str, Any]] = []
    if isinstance(spec.get("containerEdits"), Mapping):
        edits.append(spec["containerEdits"])
    for dev in spec.get("devices") or ():
        name = str(dev.get("name", ""))
        if name[:1].isdigit():
            need("0.5.0")
        if dev.get("annotations"):
            need("0.6.0")
        if isinstance(dev.get("containerEdits"), Mapping):
            edits.append(dev["containerEdits"])
    for e in edits:
        if any("hostPath" in n for n in e.get("deviceNodes") or ()):
            need("0.5.0")
        if any("type" in m for m in e.get("mounts") or ()):
            need("0.4.0")
        if e.get("intelRdt") or e.get("additionalGids"):
            need("0.7.0")
        if e.get("netDevices"):
            need("1.1.0")
    return required


def transient_spec_name(vendor: str, cls: str, ident: str) -> str:
    """CDI's transient-spec file stem: `<vendor>-<class>_<id>` with `/` in the id made `_`."""
    return f"{vendor}-{cls}_{ident.replace('/', '_')}"


@dataclass(frozen=True)
class CdiWriter:
    """Writes and removes the per-claim specs of one driver under one CDI root."""

    root: Path = DEFAULT_CDI_ROOT
    vendor: str = DEFAULT_DRIVER_NAME
    cls: str = DEFAULT_CLASS

    def __post_init__(self) -> None:
        if not _VENDOR_RE.match(self.vendor) or len(self.vendor) > 253:
            raise CdiError(f"CDI vendor {self.vendor!r} is not a DNS subdomain")
        if not _CLASS_RE.match(self.cls) or len(self.cls) > 63:
            raise CdiError(f"CDI class {self.cls!r} is not a valid CDI class name")

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.cls}"

    def spec_path(self, claim_uid: str) -> Path:
        return self.root / f"{transient_spec_name(self.vendor, self.cls, claim_uid)}.json"

    def device_id(self, claim_uid: str, device_name: str) -> str:
        """The fully qualified CDI device ID handed to the kubelet."""
        return f"{self.kind}={claim_uid}-{device_name}"

    def build_spec(
        self, claim_uid: str, devices: Sequence[CdiDevice], shared: SpecEdits = SpecEdits()
    ) -> dict[str, Any]:
        """The claim's spec: one entry per device, plus `shared` (driver files, hooks) once."""
        if not devices:
            raise CdiError(f"claim {claim_uid}: a CDI spec needs at least one device")
        spec: dict[str, Any] = {
            "cdiVersion": "",
            "kind": self.kind,
            "devices": [
                {
                    "name": f"{claim_uid}-{d.name}",
                    "containerEdits": {
                        "env": [f"{k}={v}" for k, v in sorted(d.env.items())],
                        "deviceNodes": [n.to_json() for n in d.device_nodes],
                    },
                }
                for d in devices
            ],
        }
        if shared:
            spec["containerEdits"] = shared.to_json()
        spec["cdiVersion"] = minimum_version(spec)
        validate_spec(spec)
        return spec

    def write(
        self, claim_uid: str, devices: Sequence[CdiDevice], shared: SpecEdits = SpecEdits()
    ) -> tuple[str, ...]:
        """Write (or atomically replace) the claim's spec; return its CDI device IDs in order."""
        spec = self.build_spec(claim_uid, devices, shared)
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write(self.spec_path(claim_uid), json.dumps(spec, indent=2).encode() + b"\n")
        return tuple(self.device_id(claim_uid, d.name) for d in devices)

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec; True if a file was removed. Missing files are fine."""
        try:
            self.spec_path(claim_uid).unlink()
        except FileNotFoundError:
            return False
        _fsync_dir(self.root)
        return True

    def claim_uids_on_disk(self) -> set[str]:
        """UIDs of every claim spec of this vendor/class under the root (to find orphans)."""
        prefix = transient_spec_name(self.vendor, self.cls, "")
        if not self.root.is_dir():
            return set()
        return {
            p.name[len(prefix) : -len(".json")]
            for p in self.root.iterdir()
            if p.name.startswith(prefix) and p.name.endswith(".json")
        }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never a mix."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


# --- validation (build_spec checks every spec it writes); loading and resolving, for tests -----

_TOP_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
_EDIT_FIELDS = {
    "env",
    "deviceNodes",
    "hooks",
    "mounts",
    "intelRdt",
    "additionalGids",
    "netDevices",
}
_NODE_FIELDS = {
    "path",
    "hostPath",
    "type",
    "major",
    "minor",
    "fileMode",
    "permissions",
    "uid",
    "gid",
}


_MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}
_HOOK_FIELDS = {"hookName", "path", "args", "env", "timeout"}


def _unknown(where: str, obj: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise CdiError(f"{where}: unknown field(s) {', '.join(extra)}")


def _items(where: str, edits: Mapping[str, Any], key: str) -> list[Any]:
    value = edits.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise CdiError(f"{where}.{key}: must be a list")
    return value


def _objects(
    where: str, edits: Mapping[str, Any], key: str, allowed: set[str]
) -> list[tuple[str, Mapping[str, Any]]]:
    """The objects of list `key`, each with where it is, after an unknown-field check."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for i, obj in enumerate(_items(where, edits, key)):
        w = f"{where}.{key}[{i}]"
        if not isinstance(obj, Mapping):
            raise CdiError(f"{w}: must be an object")
        _unknown(w, obj, allowed)
        out.append((w, obj))
    return out


def _absolute(where: str, obj: Mapping[str, Any], key: str, *, required: bool = True) -> None:
    value = obj.get(key)
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.startswith("/"):
        raise CdiError(f"{where}: {key} must be an absolute path, got {value!r}")


def _strings(where: str, obj: Mapping[str, Any], key: str) -> None:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CdiError(f"{where}: {key} must be a list of strings")


def _env_list(where: str, values: list[Any]) -> None:
    for i, env in enumerate(values):
        if not isinstance(env, str) or not _ENV_RE.match(env):
            raise CdiError(f"{where}[{i}]: {env!r} is not NAME=VALUE")


def _validate_edits(where: str, edits: Any) -> None:
    if not isinstance(edits, Mapping):
        raise CdiError(f"{where}: containerEdits must be an object")
    _unknown(where, edits, _EDIT_FIELDS)
    _env_list(f"{where}.env", _items(where, edits, "env"))
    for w, node in _objects(where, edits, "deviceNodes", _NODE_FIELDS):
        _absolute(w, node, "path")
        _absolute(w, node, "hostPath", required=False)
        if node.get("type", "c") not in ("c", "b", "p"):
            raise CdiError(f"{w}: type must be c, b or p")
        for key in ("major", "minor", "fileMode"):
            if key in node and (not isinstance(node[key], int) or node[key] < 0):
                raise CdiError(f"{w}: {key} must be a non-negative integer")
    for w, mount in _objects(where, edits, "mounts", _MOUNT_FIELDS):
        # CDI only insists on non-empty paths; OCI wants an absolute destination, and a relative
        # host path would be resolved against whatever directory the runtime happens to run in.
        _absolute(w, mount, "hostPath")
        _absolute(w, mount, "containerPath")
        _strings(w, mount, "options")
        if "type" in mount and not isinstance(mount["type"], str):
            raise CdiError(f"{w}: type must be a string")
    for w, hook in _objects(where, edits, "hooks", _HOOK_FIELDS):
        if hook.get("hookName") not in HOOK_NAMES:
            raise CdiError(
                f"{w}: hookName {hook.get('hookName')!r} is not one of {', '.join(HOOK_NAMES)}"
            )
        _absolute(w, hook, "path")
        _strings(w, hook, "args")
        _strings(w, hook, "env")
        _env_list(f"{w}.env", hook.get("env") or [])
        timeout = hook.get("timeout")
        if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
            raise CdiError(f"{w}: timeout must be a positive integer (seconds)")


def validate_spec(spec: Mapping[str, Any]) -> None:
    """Reject what the CDI Go library rejects: unknown fields, bad names, too low a version."""
    _unknown("spec", spec, _TOP_FIELDS)
    version = spec.get("cdiVersion")
    if version not in _KNOWN_VERSIONS:
        raise CdiError(f"spec: unsupported cdiVersion {version!r}")
    assert isinstance(version, str)
    need = minimum_version(spec)
    if _version_key(version) < _version_key(need):
        raise CdiError(f"spec: content needs cdiVersion >= {need}, declares {version}")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind.count("/") != 1:
        raise CdiError(f"spec: kind {kind!r} is not vendor/class")
    vendor, cls = kind.split("/")
    if not _VENDOR_RE.match(vendor) or not _CLASS_RE.match(cls):
        raise CdiError(f"spec: kind {kind!r} has an invalid vendor or class")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise CdiError("spec: devices must be a non-empty list")
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        w = f"devices[{i}]"
        if not isinstance(dev, Mapping):
            raise CdiError(f"{w}: must be an object")
        _unknown(w, dev, _DEVICE_FIELDS)
        name = dev.get("name")
        if not isinstance(name, str) or not _DEVICE_NAME_RE.match(name):
            raise CdiError(f"{w}: invalid device name {name!r}")
        if name in seen:
            raise CdiError(f"{w}: duplicate device name {name!r}")
        seen.add(name)
        _validate_edits(f"{w}.containerEdits", dev.get("containerEdits", {}))
    if "containerEdits" in spec:
        _validate_edits("spec.containerEdits", spec["containerEdits"])


def load_spec(path: Path) -> dict[str, Any]:
    """Load and validate one spec file (JSON, which is also what carve writes)."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CdiError(f"{path}: cannot read CDI spec: {e}") from e
    if not isinstance(spec, dict):
        raise CdiError(f"{path}: a CDI spec must be a JSON object")
    try:
        validate_spec(spec)
    except CdiError as e:
        raise CdiError(f"{path}: {e}") from e
    return spec


def parse_device_id(device_id: str) -> tuple[str, str]:
    """Split `vendor/class=name` into (kind, name)."""
    kind, sep, name = device_id.partition("=")
    if not sep or kind.count("/") != 1 or not _DEVICE_NAME_RE.match(name):
        raise CdiError(f"{device_id!r} is not a qualified CDI device ID (vendor/class=name)")
    return kind, name


@dataclass(frozen=True)
class ContainerEdits:
    """The union of edits a runtime would apply for a set of CDI device IDs."""

    env: tuple[str, ...]
    device_nodes: tuple[Mapping[str, Any], ...]
    mounts: tuple[Mapping[str, Any], ...] = ()
    hooks: tuple[Mapping[str, Any], ...] = ()


def resolve(roots: Iterable[Path], device_ids: Sequence[str]) -> ContainerEdits:
    """Resolve device IDs against the spec directories as a runtime does (later roots win).

    As in the CDI library, a spec's own containerEdits are applied once, before the edits of the
    first of its devices that is asked for; each device's edits follow in the order asked.
    """
    by_id: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.suffix != ".json":
                continue
            spec = load_spec(path)
            for dev in spec["devices"]:
                by_id[f"{spec['kind']}={dev['name']}"] = (spec, dev)
    out: dict[str, list[Any]] = {"env": [], "deviceNodes": [], "mounts": [], "hooks": []}
    applied: set[int] = set()
    for device_id in device_ids:
        parse_device_id(device_id)
        if device_id not in by_id:
            raise CdiError(f"unresolvable CDI device {device_id!r}")
        owner, dev = by_id[device_id]
        layers = [dev.get("containerEdits") or {}]
        if id(owner) not in applied:
            applied.add(id(owner))
            layers.insert(0, owner.get("containerEdits") or {})
        for edits in layers:
            for key, acc in out.items():
                acc.extend(edits.get(key) or ())
    return ContainerEdits(
        tuple(out["env"]), tuple(out["deviceNodes"]), tuple(out["mounts"]), tuple(out["hooks"])
    )
