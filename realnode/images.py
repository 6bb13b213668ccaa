"""The two container images a real node needs, built locally as OCI archives (no registry).

This machine reaches no container registry, so the sandbox image and the image test pods run
are made here from files already on disk: carve's own pause program (hack/node/build.sh) and
Debian's statically linked busybox. The archives are OCI image layouts in a tar file, which
``ctr images import`` loads into the namespace containerd's CRI serves the kubelet from.

Output is byte-for-byte deterministic (fixed mtimes and owners, sorted entries, canonical
JSON), so an archive's hash depends only on its inputs; archives are cached under a name made
from the inputs' hashes, and a second build is a file lookup.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The CRI's sandbox image (containerd's pinned_images.sandbox). The tag is the upstream pause
# release whose role it plays; the binary is carve's (hack/node/cmd/pause).
PAUSE_IMAGE = "carve.local/pause:3.10"
# What test pods run: Debian 12's busybox-static is BusyBox 1.35.0.
TEST_IMAGE = "carve.local/busybox:1.35"

# containerd's CRI keeps the kubelet's images and containers in this namespace.
CRI_NAMESPACE = "k8s.io"

# Labels given on import: "pinned" keeps the kubelet's image GC away from both images (they
# cannot be pulled back), "managed" is what the CRI itself sets on images it pulled.
_IMPORT_LABELS = ("io.cri-containerd.pinned=pinned", "io.cri-containerd.image=managed")

MEDIA_TYPE_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER = "application/vnd.oci.image.layer.v1.tar"
# containerd's import names an image from this annotation (the full reference); the OCI one
# carries only the tag, as the image-layout spec suggests and containerd's own export writes.
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
ANNOTATION_OCI_REF_NAME = "org.opencontainers.image.ref.name"

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Bump when the archive layout written here changes, so cached archives are rebuilt.
_FORMAT = "carve-oci-1"
# Every timestamp inside an archive: the archives must not depend on when they were built.
_EPOCH = 0
_CREATED = "1970-01-01T00:00:00Z"
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class ImageArchive:
    """One image as an OCI archive on disk, and the reference it is imported under."""

    name: str
    path: Path


def default_cache() -> Path:
    """Where archives are kept between runs: beside the node binaries, outside the repo."""
    root = os.environ.get("CARVE_CACHE") or str(Path.home() / ".cache" / "carve")
    return Path(root) / "node" / "images"


def build_archives(
    node_bin: Path, cache: Path, *, busybox: Path | None = None
) -> tuple[ImageArchive, ...]:
    """The pause image and the test image, built into ``cache`` unless already there.

    ``node_bin`` is hack/node/build.sh's bin directory (it holds ``pause``); busybox is the
    one Debian installed (recorded in ``packages.env`` beside that directory) unless given.
    """
    busybox = busybox or find_busybox(node_bin)
    return (
        _cached(cache, PAUSE_IMAGE, [node_bin / "pause"], lambda: _pause_image(node_bin)),
        _cached(cache, TEST_IMAGE, [busybox], lambda: _busybox_image(busybox)),
    )


def import_archives(ctr: Path, address: Path, archives: Iterable[ImageArchive]) -> None:
    """Load the archives into a running containerd's CRI namespace, unpacked for its default
    snapshotter (overlayfs), so the kubelet finds them without pulling."""
    for archive in archives:
        done = subprocess.run(
            [
                str(ctr),
                "--address",
                str(address),
                "--namespace",
                CRI_NAMESPACE,
                "images",
                "import",
                *(arg for label in _IMPORT_LABELS for arg in ("--label", label)),
                str(archive.path),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"ctr images import {archive.path} ({archive.name}) failed with exit code "
                f"{done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
            )


def find_busybox(node_bin: Path) -> Path:
    """Debian's static busybox: where hack/node/build.sh recorded it, else on PATH."""
    recorded = _read_env(node_bin.parent / "packages.env").get("BUSYBOX")
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    found = shutil.which("busybox")
    if found is None:
        raise FileNotFoundError(
            "busybox not found: run hack/node/build.sh as root (it installs busybox-static)"
        )
    return Path(found)


# -- the two images ------------------------------------------------------------------------


def _pause_image(node_bin: Path) -> bytes:
    pause = node_bin / "pause"
    layer = _layer([_File("pause", pause.read_bytes(), 0o755)])
    return oci_archive(PAUSE_IMAGE, [layer], {"Entrypoint": ["/pause"], "Env": [f"PATH={_PATH}"]})


def _busybox_image(busybox: Path) -> bytes:
    applets = _applets(busybox)
    entries: list[_Entry] = [
        _Dir("bin"),
        _Dir("dev"),
        _Dir("etc"),
        _Dir("proc"),
        _Dir("root", 0o700),
        _Dir("sys"),
        _Dir("tmp", 0o1777),
        _Dir("usr"),
        _Dir("usr/bin"),
        _Dir("var"),
        _File("bin/busybox", busybox.read_bytes(), 0o755),
        _File("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"),
        _File("etc/group", b"root:x:0:\nnogroup:x:65534:\n"),
    ]
    entries += [_Link(f"bin/{applet}", "busybox") for applet in applets if applet != "busybox"]
    # /usr/bin/env is where scripts' "#!/usr/bin/env" lines look.
    entries.append(_Link("usr/bin/env", "../../bin/busybox"))
    config = {"Env": [f"PATH={_PATH}"], "Cmd": ["sh"], "WorkingDir": "/"}
    return oci_archive(TEST_IMAGE, [_layer(entries)], config)


def _applets(busybox: Path) -> list[str]:
    listed = subprocess.run(
        [str(busybox), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    if "sh" not in listed:
        raise RuntimeError(f"{busybox} has no sh applet; the test image needs /bin/sh")
    return sorted(set(listed))


# -- OCI layout ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    path: str
    data: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class _Dir:
    path: str
    mode: int = 0o755


@dataclass(frozen=True)
class _Link:
    path: str
    target: str


_Entry = _File | _Dir | _Link


def _layer(entries: Sequence[_Entry]) -> bytes:
    """An uncompressed layer tar: root-owned, epoch mtimes, entries in path order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(entry.path)
            info.mtime = _EPOCH
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if isinstance(entry, _Dir):
                info.type = tarfile.DIRTYPE
                info.mode = entry.mode
                tar.addfile(info)
            elif isinstance(entry, _Link):
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                info.mode = 0o777
                tar.addfile(info)
            else:
                info.mode = entry.mode
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
    return out.getvalue()


def oci_archive(name: str, layers: Sequence[bytes], container_config: Mapping[str, Any]) -> bytes:
    """An OCI image layout (oci-layout, index.json, blobs/sha256/...) as one tar; `layers`
    are uncompressed layer tars, base first."""
    arch = _GOARCH.get(platform.machine().lower(), platform.machine().lower())
    config = _json(
        {
            "architecture": arch,
            "os": "linux",
            "created": _CREATED,
            "config": dict(container_config),
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer) for layer in layers]},
            "history": [
                {"created": _CREATED, "created_by": "carve realnode/images.py"} for _ in layers
            ],
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": _descriptor(MEDIA_TYPE_CONFIG, config),
            "layers": [_descriptor(MEDIA_TYPE_LAYER, layer) for layer in layers],
        }
    )
    tag = name.rsplit(":", 1)[1]
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_INDEX,
            "manifests": [
                {
                    **_descriptor(MEDIA_TYPE_MANIFEST, manifest),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        ANNOTATION_CONTAINERD_NAME: name,
                        ANNOTATION_OCI_REF_NAME: tag,
                    },
                }
            ],
        }
    )
    blobs = {_digest(b).split(":", 1)[1]: b for b in (*layers, config, manifest)}
    files: list[_Entry] = [
        _File("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
        _File("index.json", index),
        _Dir("blobs"),
        _Dir("blobs/sha256"),
        *(_File(f"blobs/sha256/{hex_}", blob) for hex_, blob in blobs.items()),
    ]
    return _layer(files)


def _descriptor(media_type: str, blob: bytes) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": _digest(blob), "size": len(blob)}


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# -- cache ---------------------------------------------------------------------------------


def _cached(
    cache: Path, name: str, inputs: Sequence[Path], build: Callable[[], bytes]
) -> ImageArchive:
    """The archive for ``name`` from the given inputs, built by ``build()`` only if the cache
    holds none for exactly these input bytes."""
    key = hashlib.sha256(f"{_FORMAT}\n{name}\n{platform.machine()}\n".encode())
    for path in inputs:
        key.update(hashlib.sha256(path.read_bytes()).digest())
    stem = name.replace("/", "_").replace(":", "_")
    target = cache / f"{stem}-{key.hexdigest()[:16]}.tar"
    if not target.is_file():
        data = build()
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return ImageArchive(name=name, path=target)


def _read_env(path: Path) -> dict[str, str]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    values: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values
