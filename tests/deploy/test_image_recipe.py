"""deploy/Dockerfile and deploy/image/build.py are one recipe built two ways (docker build where
a registry is reachable, mmdebstrap + an OCI archive where none is): they must agree on what
goes into the image. Building it takes minutes and root; `python deploy/image/build.py` does."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from types import ModuleType

from tests.support.helm import REPO

DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "carve_image_build", REPO / "deploy/image/build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_builders_copy_every_shipped_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (\w+) \./\1$", DOCKERFILE, re.M))
    assert copied == shipped
    assert set(_builder().SOURCES) == shipped | {"pyproject.toml", "README.md"}


def test_both_builders_make_the_same_image() -> None:
    build = _builder()
    assert "COPY deploy/image/debian-packages" in DOCKERFILE
    assert build.PACKAGES_FILE == REPO / "deploy" / "image" / "debian-packages"
    assert "python3" in build.packages() and "libstdc++6" in build.packages()
    assert f"/stage/ {build.SITE_PACKAGES}/" in DOCKERFILE
    assert f"echo '{build.USER}' >> /etc/passwd" in DOCKERFILE
    assert f"echo '{build.GROUP}' >> /etc/group" in DOCKERFILE
    assert "FROM debian:bookworm-slim" in DOCKERFILE and build.SUITE == "bookworm"
    assert "USER 65532" in DOCKERFILE
    assert 'CMD ["carve-controller", "--help"]' in DOCKERFILE
    assert "--invalidation-mode unchecked-hash" in DOCKERFILE
