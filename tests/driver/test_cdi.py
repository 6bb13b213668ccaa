from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver import cdi
from driver.cdi import CdiDevice, CdiError, CdiWriter, mig_device_nodes

UID = "0d1f7c8e-5d2a-4c59-9d7e-2b1f9a0c3e11"


def _mig_device(name: str = "gpu-0-mig-1g10gb-19-6") -> CdiDevice:
    nodes = mig_device_nodes(gpu_minor=0, caps_major=511, gi_cap_minor=66, ci_cap_minor=67)
    return CdiDevice(name, nodes, {"NVIDIA_VISIBLE_DEVICES": "MIG-abc"})


def test_spec_file_name_follows_transient_convention(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path, vendor="mig.carve.dev")
    ids = w.write(UID, [_mig_device()])
    assert ids == (f"mig.carve.dev/claim={UID}-gpu-0-mig-1g10gb-19-6",)
    assert w.spec_path(UID) == tmp_path / f"mig.carve.dev-claim_{UID}.json"
    assert w.spec_path(UID).is_file()


def test_device_nodes_are_fully_specified(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    w.write(UID, [_mig_device()])
    spec = json.loads(w.spec_path(UID).read_text())
    (dev,) = spec["devices"]
    nodes = {n["path"]: n for n in dev["containerEdits"]["deviceNodes"]}
    assert set(nodes) == {
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap66",
        "/dev/nvidia-caps/nvidia-cap67",
        "/dev/nvidiactl",
    }
    assert nodes["/dev/nvidia-caps/nvidia-cap66"] == {
        "path": "/dev/nvidia-caps/nvidia-cap66",
        "type": "c",
        "major": 511,
        "minor": 66,
        "fileMode": 0o444,
    }
    assert nodes["/dev/nvidiactl"]["major"] == 195 and nodes["/dev/nvidiactl"]["minor"] == 255
    assert all(n["type"] == "c" and n["major"] != 0 for n in nodes.values())
    assert "NVIDIA_VISIBLE_DEVICES=MIG-abc" in dev["containerEdits"]["env"]


def test_version_is_minimum_for_content(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    # a UID starting with a digit needs 0.5.0
    assert w.build_spec(UID, [_mig_device()])["cdiVersion"] == "0.5.0"
    assert w.build_spec("abc", [_mig_device()])["cdiVersion"] == "0.3.0"
    assert cdi.minimum_version({"kind": "a.b/c.d", "devices": []}) == "0.6.0"
    assert (
        cdi.minimum_version(
            {"kind": "a.b/c", "devices": [{"name": "x", "containerEdits": {"netDevices": [{}]}}]}
        )
        == "1.1.0"
    )


def test_write_replaces_atomically_and_leaves_no_temp_files(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    w.write(UID, [_mig_device("a")])
    w.write(UID, [_mig_device("b")])
    assert os.listdir(tmp_path) == [w.spec_path(UID).name]
    spec = cdi.load_spec(w.spec_path(UID))
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-b"]


def test_failed_write_keeps_old_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = CdiWriter(tmp_path)
    w.write(UID, [_mig_device("old")])

    def boom(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        w.write(UID, [_mig_device("new")])
    monkeypatch.undo()
    assert [d["name"] for d in cdi.load_spec(w.spec_path(UID))["devices"]] == [f"{UID}-old"]
    assert os.listdir(tmp_path) == [w.spec_path(UID).name]


def test_remove_is_idempotent(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    w.write(UID, [_mig_device()])
    assert w.claim_uids_on_disk() == {UID}
    assert w.remove(UID) is True
    assert w.remove(UID) is False
    assert w.claim_uids_on_disk() == set()


def test_resolve_returns_edits_for_written_ids(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    ids = w.write(UID, [_mig_device("a"), _mig_device("b")])
    edits = cdi.resolve([tmp_path], ids)
    assert len(edits.device_nodes) == 8
    with pytest.raises(CdiError, match="unresolvable"):
        cdi.resolve([tmp_path], [f"mig.carve.dev/claim={UID}-zzz"])
    with pytest.raises(CdiError, match="qualified"):
        cdi.resolve([tmp_path], ["not-an-id"])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(extra=1), "unknown field"),
        (lambda s: s.update(cdiVersion="0.3.0"), "needs cdiVersion >= 0.5.0"),
        (lambda s: s.update(cdiVersion="9.9.9"), "unsupported cdiVersion"),
        (lambda s: s.update(kind="noslash"), "vendor/class"),
        (lambda s: s.update(devices=[]), "non-empty"),
        (lambda s: s["devices"][0].update(name="bad name"), "invalid device name"),
        (lambda s: s["devices"].append(dict(s["devices"][0])), "duplicate"),
        (lambda s: s["devices"][0]["containerEdits"]["env"].append("=x"), "NAME=VALUE"),
        (
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="dev/x"),
            "absolute",
        ),
        (
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(bogus=1),
            "unknown field",
        ),
    ],
)
def test_validator_rejects_bad_specs(tmp_path: Path, mutate: object, message: str) -> None:
    spec = CdiWriter(tmp_path).build_spec(UID, [_mig_device()])
    mutate(spec)  # type: ignore[operator]
    with pytest.raises(CdiError, match=message):
        cdi.validate_spec(spec)


def test_invalid_vendor_rejected(tmp_path: Path) -> None:
    with pytest.raises(CdiError, match="DNS subdomain"):
        CdiWriter(tmp_path, vendor="Bad_Vendor")


@given(
    uid=st.uuids().map(str),
    names=st.lists(
        st.from_regex(r"gpu-[0-9]{1,2}(-mig-[a-z0-9]{4,6}-[0-9]{1,2}-[0-9])?", fullmatch=True),
        min_size=1,
        max_size=4,
        unique=True,
    ),
)
def test_written_specs_always_load_and_resolve(uid: str, names: list[str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        w = CdiWriter(Path(d))
        ids = w.write(uid, [_mig_device(n) for n in names])
        assert len(cdi.resolve([Path(d)], ids).device_nodes) == 4 * len(names)


def test_uvm_nodes() -> None:
    nodes = cdi.uvm_device_nodes(uvm_major=510)
    assert [(n.path, n.major, n.minor, n.type) for n in nodes] == [
        ("/dev/nvidia-uvm", 510, 0, "c"),
        ("/dev/nvidia-uvm-tools", 510, 1, "c"),
    ]


# --- driver files and hooks at spec level; device nodes under a dev root ------------------------

_SHARED = cdi.SpecEdits(
    mounts=(
        cdi.Mount(
            "/run/nvidia/driver/usr/lib64/libcuda.so.580.105.08",
            "/usr/lib64/libcuda.so.580.105.08",
        ),
        cdi.Mount("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
    ),
    hooks=(
        cdi.Hook(
            "/usr/bin/nvidia-cdi-hook",
            ("nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"),
        ),
    ),
)


def test_shared_edits_sit_once_at_spec_level(tmp_path: Path) -> None:
    w = CdiWriter(tmp_path)
    ids = w.write("abc", [_mig_device("a"), _mig_device("b")], _SHARED)
    spec = cdi.load_spec(w.spec_path("abc"))
    assert spec["cdiVersion"] == "0.3.0"
    assert spec["containerEdits"] == {
        "mounts": [
            {
                "hostPath": "/run/nvidia/driver/usr/lib64/libcuda.so.580.105.08",
                "containerPath": "/usr/lib64/libcuda.so.580.105.08",
                "options": ["ro", "nosuid", "nodev", "bind"],
            },
            {
                "hostPath": "/run/nvidia/driver/usr/bin/nvidia-smi",
                "containerPath": "/usr/bin/nvidia-smi",
                "options": ["ro", "nosuid", "nodev", "bind"],
            },
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"],
            }
        ],
    }
    assert all("mounts" not in d["containerEdits"] for d in spec["devices"])
    # A runtime applies the spec's own edits once, however many of its devices a container gets.
    edits = cdi.resolve([tmp_path], ids)
    assert len(edits.mounts) == 2 and len(edits.hooks) == 1
    assert len(edits.device_nodes) == 8
    # Without shared edits the spec has no containerEdits at all (as before).
    assert "containerEdits" not in w.build_spec("abc", [_mig_device()])


def test_device_nodes_under_a_dev_root_get_host_paths(tmp_path: Path) -> None:
    nodes = mig_device_nodes(gpu_minor=0, caps_major=511, gi_cap_minor=66, ci_cap_minor=67)
    assert [n.under(Path("/")) for n in nodes] == list(nodes)
    moved = [n.under(Path("/var/lib/carve/node-a/dev-root")) for n in nodes]
    assert [n.to_json()["hostPath"] for n in moved] == [
        f"/var/lib/carve/node-a/dev-root{n.path}" for n in nodes
    ]
    assert [(m.path, m.major, m.minor) for m in moved] == [
        (n.path, n.major, n.minor) for n in nodes
    ]
    w = CdiWriter(tmp_path)
    spec = w.build_spec("abc", [CdiDevice("a", tuple(moved))])
    assert spec["cdiVersion"] == "0.5.0"  # hostPath on a device node is a 0.5.0 field
    assert (
        "hostPath"
        not in w.build_spec("abc", [CdiDevice("a", nodes)])["devices"][0]["containerEdits"][
            "deviceNodes"
        ][0]
    )


def _spec_with_shared(tmp_path: Path) -> dict[str, object]:
    return CdiWriter(tmp_path).build_spec(UID, [_mig_device()], _SHARED)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda e: e["mounts"][0].update(containerPath="usr/lib"),
            "containerPath must be an absolute",
        ),
        (lambda e: e["mounts"][0].update(hostPath=""), "hostPath must be an absolute"),
        (lambda e: e["mounts"][0].update(options="ro"), "options must be a list of strings"),
        (lambda e: e["mounts"][0].update(propagation="x"), "unknown field"),
        (lambda e: e.update(mounts={"a": 1}), "mounts: must be a list"),
        (lambda e: e["hooks"][0].update(hookName="preStart"), "hookName 'preStart' is not"),
        (lambda e: e["hooks"][0].update(path=""), "path must be an absolute"),
        (lambda e: e["hooks"][0].update(args="nvidia-cdi-hook"), "args must be a list"),
        (lambda e: e["hooks"][0].update(env=["=x"]), "NAME=VALUE"),
        (lambda e: e["hooks"][0].update(timeout=0), "timeout must be a positive"),
        (lambda e: e["hooks"][0].update(when="now"), "unknown field"),
    ],
)
def test_validator_rejects_bad_mounts_and_hooks(
    tmp_path: Path, mutate: object, message: str
) -> None:
    spec = _spec_with_shared(tmp_path)
    mutate(spec["containerEdits"])  # type: ignore[operator]
    with pytest.raises(CdiError, match=message):
        cdi.validate_spec(spec)


def test_validator_rejects_relative_device_host_path(tmp_path: Path) -> None:
    spec = CdiWriter(tmp_path).build_spec(UID, [_mig_device()])
    spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] = "dev/nvidia0"
    with pytest.raises(CdiError, match="hostPath must be an absolute path"):
        cdi.validate_spec(spec)


@given(
    dev_root=st.from_regex(r"(/[a-z0-9._-]{1,8}){0,4}", fullmatch=True),
    minor=st.integers(0, 31),
    gi=st.integers(0, 14),
)
def test_every_host_path_is_the_dev_root_plus_the_path(dev_root: str, minor: int, gi: int) -> None:
    root = Path(dev_root or "/")
    nodes = mig_device_nodes(gpu_minor=minor, caps_major=508, gi_cap_minor=gi, ci_cap_minor=gi + 1)
    for n in (x.under(root) for x in nodes):
        host = n.to_json().get("hostPath", n.path)
        assert host == (n.path if root == Path("/") else f"{root}{n.path}")
