"""Wire compatibility with the upstream Go API packages, independent of carve's own stubs.

hack/kubeletclient is built from k8s.io/kubelet (v0.37.2) and google.golang.org/grpc through the Go
module proxy. If carve's .proto files differed from upstream in a package, service, method or
field number, these calls would fail or decode to empty values.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubeletplugin.ports import ClaimRef
from tests.kubeletplugin.fake_preparer import (
    DRIVER,
    FakePreparer,
    device_for,
    running_plugin,
    short_tmpdir,
)

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "hack" / "kubeletclient"
GO = shutil.which("go")

pytestmark = pytest.mark.skipif(
    GO is None and not os.environ.get("CARVE_REQUIRE_CLUSTER"),
    reason="Go toolchain not on PATH: the upstream-built kubelet client cannot be built "
    "(CI has Go and runs this test)",
)

A = ClaimRef(namespace="team-a", name="train", uid="0e6b1d5c-a")
B = ClaimRef(namespace="team-b", name="infer", uid="0e6b1d5c-b")


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "carve" / "kubeletclient"


@pytest.fixture(scope="module")
def client() -> Path:
    """Build once per source revision; later runs reuse the binary outside the repository."""
    assert GO is not None
    version = subprocess.run(
        [GO, "version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    digest = hashlib.sha256(version.encode())
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((SOURCE / name).read_bytes())
    binary = _cache_dir() / digest.hexdigest()[:16] / "kubeletclient"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(f".tmp{os.getpid()}")  # two runs at once: each its own
        build = subprocess.run(
            [GO, "build", "-mod=readonly", "-buildvcs=false", "-o", str(tmp), "."],
            cwd=SOURCE,
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
        assert build.returncode == 0, f"building {SOURCE} failed:\n{build.stderr}"
        tmp.replace(binary)
    return binary


@pytest.fixture
def root() -> Iterator[Path]:
    with short_tmpdir() as path:
        yield path


def _run(
    client: Path, reg_socket: Path, claims: list[ClaimRef], *extra: str, driver: str = DRIVER
) -> subprocess.CompletedProcess[str]:
    args = [str(client), "-registration", str(reg_socket), "-driver", driver, *extra]
    for claim in claims:
        args += ["-claim", f"{claim.namespace}/{claim.name}/{claim.uid}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def _device_json(claim: ClaimRef, share_id: str | None) -> dict[str, Any]:
    device = device_for(claim)
    return {
        "request_names": list(device.request_names),
        "pool_name": device.pool_name,
        "device_name": device.device_name,
        "cdi_device_ids": list(device.cdi_device_ids),
        "share_id": share_id,
    }


def test_go_client_registers_and_prepares_over_v1(client: Path, root: Path) -> None:
    preparer = FakePreparer(
        prepare_errors={B.uid: "claim team-b/infer: placement taken"},
        share_ids={A.uid: "7f1c2a9e-0000-4000-8000-00000000000a"},
    )
    with running_plugin(root, preparer) as server:
        done = _run(client, server.paths.registration, [A, B])
        assert done.returncode == 0, done.stderr
        assert server.registration.registered
    out = json.loads(done.stdout)
    assert out["info"] == {
        "type": "DRAPlugin",
        "name": DRIVER,
        "endpoint": str(root / "plugins" / DRIVER / "dra.sock"),
        "supported_versions": [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1alpha1.DRAResourceHealth",
            "v1.DRAResourceHealth",
        ],
    }
    assert out["prepare"] == {
        A.uid: {
            "devices": [_device_json(A, "7f1c2a9e-0000-4000-8000-00000000000a")],
            "error": "",
        },
        B.uid: {"devices": [], "error": "claim team-b/infer: placement taken"},
    }
    assert out["unprepare"] == {A.uid: {"error": ""}, B.uid: {"error": ""}}
    assert preparer.prepare_calls == [(A, B)]
    assert preparer.unprepare_calls == [(A, B)]


def test_go_client_over_v1beta1(client: Path, root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        done = _run(client, server.paths.registration, [A], "-api", "v1beta1")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["prepare"] == {A.uid: {"devices": [_device_json(A, None)], "error": ""}}
    assert out["unprepare"] == {A.uid: {"error": ""}}


def test_go_client_liveness_probe_with_no_claims(client: Path, root: Path) -> None:
    preparer = FakePreparer()
    with running_plugin(root, preparer) as server:
        done = _run(client, server.paths.registration, [])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["prepare"] == {}
    assert out["unprepare"] == {}
    assert preparer.prepare_calls == []


def test_go_client_rejection_reaches_the_plugin(client: Path, root: Path) -> None:
    with running_plugin(root, FakePreparer()) as server:
        done = _run(client, server.paths.registration, [A], driver="gpu.example.com")
        state = server.registration
    assert done.returncode == 1
    assert "plugin name" in done.stderr
    assert state.notified
    assert not state.registered
    assert "gpu.example.com" in state.error
