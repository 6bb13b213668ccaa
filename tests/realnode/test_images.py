"""realnode.images: the local OCI archives are valid image layouts that containerd can
import, and they are reproducible, because the real-node suite imports them into every node
and caches them by their inputs. None of this needs containerd: fake inputs stand in for the
pause binary and busybox, and a fake ctr records its command line."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from realnode import images

_APPLETS = ("busybox", "cat", "ls", "sh", "sleep")


@pytest.fixture
def node_bin(tmp_path: Path) -> Path:
    """A node bin dir as hack/node/build.sh leaves it: pause inside, packages.env beside."""
    bin_dir = tmp_path / "node" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "pause").write_bytes(b"\x7fELF fake pause")
    (bin_dir / "pause").chmod(0o755)
    busybox = tmp_path / "busybox"
    busybox.write_text(
        '#!/bin/sh\n[ "$1" = --list ] && printf "%s\\n" ' + " ".join(_APPLETS) + "\n"
    )
    busybox.chmod(0o755)
    (bin_dir.parent / "packages.env").write_text(
        f"RUNC=/usr/sbin/runc\nCNI_BIN_DIR=/usr/lib/cni\nBUSYBOX={busybox}\n"
    )
    return bin_dir


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        out: dict[str, bytes] = {}
        for member in tar.getmembers():
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                out[member.name] = extracted.read()
        return out


def _blob(files: dict[str, bytes], descriptor: dict[str, Any]) -> bytes:
    algorithm, hex_digest = descriptor["digest"].split(":")
    assert algorithm == "sha256"
    data = files[f"blobs/sha256/{hex_digest}"]
    assert hashlib.sha256(data).hexdigest() == hex_digest
    assert len(data) == descriptor["size"]
    return data


def _image(archive: images.ImageArchive) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """index entry, image config and layer of a one-image archive, every digest checked."""
    files = _members(archive.path)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    assert index["schemaVersion"] == 2
    assert index["mediaType"] == images.MEDIA_TYPE_INDEX
    [entry] = index["manifests"]
    assert entry["mediaType"] == images.MEDIA_TYPE_MANIFEST
    manifest = json.loads(_blob(files, entry))
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == images.MEDIA_TYPE_MANIFEST
    assert manifest["config"]["mediaType"] == images.MEDIA_TYPE_CONFIG
    config = json.loads(_blob(files, manifest["config"]))
    [layer_descriptor] = manifest["layers"]
    assert layer_descriptor["mediaType"] == images.MEDIA_TYPE_LAYER
    layer = _blob(files, layer_descriptor)
    # An uncompressed layer: its diff id is its digest.
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer_descriptor["digest"]]}
    assert {f for f in files if f.startswith("blobs/")} == {
        f"blobs/sha256/{d['digest'].split(':')[1]}"
        for d in (entry, manifest["config"], layer_descriptor)
    }
    return entry, config, layer


def test_build_archives_names_both_images(node_bin: Path, tmp_path: Path) -> None:
    archives = images.build_archives(node_bin, tmp_path / "cache")
    assert [a.name for a in archives] == [images.PAUSE_IMAGE, images.TEST_IMAGE]
    for archive in archives:
        entry, config, _ = _image(archive)
        # containerd's import names the image from the first, the OCI tag is the second.
        assert entry["annotations"] == {
            images.ANNOTATION_CONTAINERD_NAME: archive.name,
            images.ANNOTATION_OCI_REF_NAME: archive.name.rsplit(":", 1)[1],
        }
        assert entry["platform"]["os"] == config["os"] == "linux"
        assert entry["platform"]["architecture"] == config["architecture"]


def test_pause_image_runs_the_pause_binary(node_bin: Path, tmp_path: Path) -> None:
    pause, _ = images.build_archives(node_bin, tmp_path / "cache")
    _, config, layer = _image(pause)
    assert config["config"]["Entrypoint"] == ["/pause"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        member = tar.getmember("pause")
        assert member.isfile()
        assert member.mode == 0o755
        extracted = tar.extractfile(member)
        assert extracted is not None
        assert extracted.read() == (node_bin / "pause").read_bytes()


def test_test_image_has_a_shell_and_every_applet(node_bin: Path, tmp_path: Path) -> None:
    _, busybox = images.build_archives(node_bin, tmp_path / "cache")
    _, config, layer = _image(busybox)
    assert config["config"]["Cmd"] == ["sh"]
    assert "Entrypoint" not in config["config"]
    [path_env] = [e for e in config["config"]["Env"] if e.startswith("PATH=")]
    assert "/bin" in path_env.removeprefix("PATH=").split(":")
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/busybox"].isfile()
    assert members["bin/busybox"].mode == 0o755
    for applet in set(_APPLETS) - {"busybox"}:
        link = members[f"bin/{applet}"]
        assert link.issym(), applet
        assert link.linkname == "busybox"
    assert members["tmp"].mode == 0o1777
    assert all(m.uid == 0 and m.gid == 0 and m.mtime == 0 for m in members.values())
    assert list(members) == sorted(members)


def test_archives_are_reproducible(node_bin: Path, tmp_path: Path) -> None:
    first = images.build_archives(node_bin, tmp_path / "one")
    second = images.build_archives(node_bin, tmp_path / "two")
    for a, b in zip(first, second, strict=True):
        assert a.path.name == b.path.name
        assert a.path.read_bytes() == b.path.read_bytes()


def test_cache_is_reused_and_keyed_by_inputs(node_bin: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    pause, busybox = images.build_archives(node_bin, cache)
    mtime = busybox.path.stat().st_mtime_ns
    again = images.build_archives(node_bin, cache)
    assert again == (pause, busybox)
    assert busybox.path.stat().st_mtime_ns == mtime  # not rewritten
    (node_bin / "pause").write_bytes(b"\x7fELF another pause")
    new_pause, same_busybox = images.build_archives(node_bin, cache)
    assert new_pause.path != pause.path
    assert same_busybox == busybox
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp files left


def test_busybox_comes_from_packages_env_unless_given(node_bin: Path, tmp_path: Path) -> None:
    assert images.find_busybox(node_bin) == tmp_path / "busybox"
    other = tmp_path / "other-busybox"
    shutil.copy(tmp_path / "busybox", other)
    other.write_text(other.read_text().replace(" sleep", " sleep true"))
    _, busybox = images.build_archives(node_bin, tmp_path / "cache", busybox=other)
    _, _, layer = _image(busybox)
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        assert tar.getmember("bin/true").issym()


def test_import_runs_ctr_in_the_cri_namespace(node_bin: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    ctr = tmp_path / "ctr"
    ctr.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\necho >> {calls}\n')
    ctr.chmod(0o755)
    archives = images.build_archives(node_bin, tmp_path / "cache")
    images.import_archives(ctr, tmp_path / "containerd.sock", archives)
    runs = [run.split("\n") for run in calls.read_text().strip("\n").split("\n\n")]
    assert len(runs) == 2
    for run, archive in zip(runs, archives, strict=True):
        assert run[:6] == [
            "--address",
            str(tmp_path / "containerd.sock"),
            "--namespace",
            images.CRI_NAMESPACE,
            "images",
            "import",
        ]
        assert run[-1] == str(archive.path)
        assert "io.cri-containerd.pinned=pinned" in run


def test_import_failure_says_which_archive(node_bin: Path, tmp_path: Path) -> None:
    ctr = tmp_path / "ctr"
    ctr.write_text("#!/bin/sh\necho 'ctr: connection refused' >&2\nexit 1\n")
    ctr.chmod(0o755)
    archives = images.build_archives(node_bin, tmp_path / "cache")
    with pytest.raises(RuntimeError, match=r"carve\.local/pause.*connection refused"):
        images.import_archives(ctr, tmp_path / "containerd.sock", archives)


@pytest.mark.skipif(shutil.which("busybox") is None, reason="Debian's busybox-static not installed")
def test_real_busybox_lists_its_applets_into_the_image(node_bin: Path, tmp_path: Path) -> None:
    real = Path(shutil.which("busybox") or "")
    listed = subprocess.run([real, "--list"], capture_output=True, text=True, check=True)
    _, busybox = images.build_archives(node_bin, tmp_path / "cache", busybox=real)
    _, _, layer = _image(busybox)
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        names = set(tar.getnames())
    assert {f"bin/{a}" for a in listed.stdout.split()} <= names
