"""Build carve's image without any registry: an OCI archive made from Debian's packages.

    python deploy/image/build.py [--output FILE] [--name REF] [--mirror URL]

The same recipe as deploy/Dockerfile, by other means: Debian bookworm with the packages in
deploy/image/debian-packages (here made by `mmdebstrap`, there by `debian:bookworm-slim`), this
project's wheel and its dependencies from PyPI installed with pip into
/usr/local/lib/python3.11/dist-packages, their console scripts in /usr/local/bin, the user
carve (65532), and `carve-controller --help` as the command. The Deployment and the DaemonSet
name the entry point (deploy/helm/carve).

Two layers, as the Dockerfile's stages would give: the base (Debian, the dependencies, the
user) is cached in ~/.cache/carve/image under a key of its inputs (the package list, the
dependency specifiers, the suite, the mirror, BASE_FORMAT), so a change to carve's code
rebuilds only the second layer, carve's own packages, in seconds.

Needs root (mmdebstrap's root mode), mmdebstrap (`apt-get install mmdebstrap`), a Debian
mirror and PyPI; run it with a Python 3.11 (the image's), e.g. the project's .venv. Before the
archive is written, every entry point is started inside the new root file system (`--help`,
as the user carve) and every module of carve's packages is imported, so a missing module or
library fails the build, not the first pod. The archive is an
OCI image layout in one tar (realnode/images.py writes it), which `ctr images import` or
`skopeo copy oci-archive:...` take; the sizes are printed at the end.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from realnode.images import oci_archive  # noqa: E402  (the OCI layout writer)

PACKAGES_FILE = REPO / "deploy" / "image" / "debian-packages"
PACKAGES = ("driver", "process", "kubeletplugin", "controller", "carvecli")
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)
SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"
PYTHON = "/usr/bin/python3"
ENTRY_POINTS = ("carve-controller", "carve-kubelet-plugin", "carve")
# Imports every module of carve's packages (and so every dependency they import at the top).
IMPORT_ALL = (
    "import importlib, pkgutil; "
    "[importlib.import_module(m.name) for p in "
    f"{json.dumps(list(PACKAGES))} "
    'for m in pkgutil.walk_packages(importlib.import_module(p).__path__, p + ".")]'
)
USER = "carve:x:65532:65532:carve:/nonexistent:/usr/sbin/nologin"
GROUP = "carve:x:65532:"
SUITE = "bookworm"
# Part of the base layer's cache key: change it when the base recipe below changes.
BASE_FORMAT = 1
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Documentation and translations are not needed to run; the copyright files stay.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
)


def _say(text: str) -> None:
    print(f"[image] {text}", file=sys.stderr, flush=True)


def _run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(args, cwd=cwd, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{args[0]} {' '.join(args[1:4])} ... exited {done.returncode}")


def packages() -> list[str]:
    lines = (line.strip() for line in PACKAGES_FILE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _dependencies() -> list[str]:
    """The project's runtime requirements, as pyproject.toml states them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [str(d) for d in project["dependencies"]]


def _pip(*args: str) -> None:
    _run(sys.executable, "-m", "pip", "--disable-pip-version-check", *args)


def _compile(tree: Path) -> None:
    # Byte code that does not depend on file times (the root file system is read-only).
    unchecked = ("--invalidation-mode", "unchecked-hash")
    _run(sys.executable, "-m", "compileall", "-q", "-j0", *unchecked, str(tree))


def dependency_tree(work: Path) -> Path:
    """The project's dependencies (not the project) installed for the image's Python."""
    deps = work / "deps"
    _pip("install", "--quiet", "--no-compile", "--only-binary=:all:", "--target", str(deps),
         *_dependencies())  # fmt: skip
    shutil.rmtree(deps / "bin", ignore_errors=True)  # their scripts are not entry points here
    _compile(deps)
    return deps


def project_tree(work: Path) -> tuple[Path, Path]:
    """This project's wheel installed for the image's Python, without its dependencies:
    (the dist-packages tree, the console scripts)."""
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:  # a copy: building in the checkout would leave build/ behind
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(work / "wheels"), str(src))
    [wheel] = (work / "wheels").glob("carve_dra-*.whl")
    stage = work / "stage"
    _pip("install", "--quiet", "--no-deps", "--no-compile", "--target", str(stage), str(wheel))
    scripts = work / "scripts"
    (stage / "bin").rename(scripts)
    for script in scripts.iterdir():  # pip wrote this interpreter's path; the image has its own
        lines = script.read_bytes().split(b"\n", 1)
        if lines[0].startswith(b"#!"):
            script.write_bytes(f"#!{PYTHON}".encode() + b"\n" + lines[1])
    missing = [e for e in ENTRY_POINTS if not (scripts / e).is_file()]
    if missing:
        raise SystemExit(f"the wheel has no console scripts {missing}")
    _compile(stage)
    return stage, scripts


def base_layer(cache: Path, mirror: str) -> bytes:
    """Debian with the packages and the project's dependencies, and the user carve: the
    image's first layer, cached under a key of everything that goes into it."""
    key = hashlib.sha256(
        json.dumps([BASE_FORMAT, SUITE, mirror, packages(), _dependencies()]).encode()
    ).hexdigest()[:16]
    cached = cache / f"base-{key}.tar"
    if cached.is_file():
        _say(f"base layer from the cache: {cached}")
        return cached.read_bytes()
    with tempfile.TemporaryDirectory(prefix="carve-image-base-") as tmp:
        work = Path(tmp)
        _say("installing the dependencies (pip)")
        deps = dependency_tree(work)
        _say(f"making Debian {SUITE} with {', '.join(packages())} (mmdebstrap)")
        layer = _debian(work, deps, mirror).read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".tmp")
    partial.write_bytes(layer)
    partial.replace(cached)
    return layer


def _debian(work: Path, deps: Path, mirror: str) -> Path:
    """mmdebstrap's tarball of the base root file system."""
    out = work / "rootfs.tar"
    security = mirror.rstrip("/").removesuffix("/debian") + "/debian-security"
    command = [
        "mmdebstrap",
        "--variant=essential",
        "--mode=root",
        f"--include={','.join(packages())}",
        # merged /usr the debootstrap way, without the usrmerge package (it pulls in perl).
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *(f"--dpkgopt={o}" for o in DPKG_OPTIONS),
        "--skip=output/dev",
        f"--customize-hook=sync-in {deps} {SITE_PACKAGES}",
        f"--customize-hook=echo '{USER}' >> \"$1/etc/passwd\"",
        f"--customize-hook=echo '{GROUP}' >> \"$1/etc/group\"",
        '--customize-hook=rm -rf "$1/var/log/"*.log "$1/var/cache/debconf/"*-old',
        SUITE,
        str(out),
        f"deb {mirror} {SUITE} main",
        f"deb {mirror} {SUITE}-updates main",
        f"deb {security} {SUITE}-security main",
    ]
    env = dict(os.environ)
    env["SOURCE_DATE_EPOCH"] = "0"  # the layer's bytes depend on its inputs only
    _run(*command, env=env)
    return out


def project_layer(stage: Path, scripts: Path) -> bytes:
    """The second layer: carve's packages and console scripts, root-owned, epoch times."""
    out = io.BytesIO()
    trees = ((stage, SITE_PACKAGES.lstrip("/")), (scripts, "usr/local/bin"))
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for tree, prefix in trees:
            for path in sorted(tree.rglob("*")):
                info = tar.gettarinfo(str(path), f"{prefix}/{path.relative_to(tree)}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                info.mode = 0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644
                if path.is_file():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return out.getvalue()


def smoke_test(layers: list[bytes]) -> None:
    """Start every entry point (``--help``, as the user carve) and import every module in the
    image's root file system, so a missing module or library fails the build, not a pod."""
    with tempfile.TemporaryDirectory(prefix="carve-image-root-") as tmp:
        root = Path(tmp)
        for layer in layers:
            with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
                tar.extractall(root, filter="fully_trusted")
        as_carve = ("chroot", "--userspec=65532:65532", str(root))
        for e in ENTRY_POINTS:
            done = subprocess.run(
                [*as_carve, f"/usr/local/bin/{e}", "--help"], capture_output=True, check=False
            )
            if done.returncode != 0:
                raise SystemExit(f"{e} --help failed in the image:\n{done.stderr.decode()}")
        done = subprocess.run(
            [*as_carve, PYTHON, "-c", IMPORT_ALL], capture_output=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"importing carve failed in the image:\n{done.stderr.decode()}")


def main(argv: list[str] | None = None) -> int:
    cache = Path(os.environ.get("CARVE_CACHE") or Path.home() / ".cache" / "carve") / "image"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="ghcr.io/carve-dev/carve:0.1.0", help="image reference")
    parser.add_argument("--output", type=Path, help="archive path (default: in ~/.cache/carve)")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        raise SystemExit(f"run this with Python 3.11, the image's (this is {sys.version})")
    if shutil.which("mmdebstrap") is None:
        raise SystemExit("mmdebstrap not found: apt-get install mmdebstrap")
    if os.geteuid() != 0:
        raise SystemExit("mmdebstrap's root mode needs root")
    output = args.output or cache / (args.name.rsplit("/", 1)[-1].replace(":", "-") + ".oci.tar")
    layers = [base_layer(cache, args.mirror)]
    with tempfile.TemporaryDirectory(prefix="carve-image-") as tmp:
        _say("building carve's wheel")
        layers.append(project_layer(*project_tree(Path(tmp))))
    _say("starting every entry point in the image")
    smoke_test(layers)
    config = {
        "User": "65532",
        "Env": [f"PATH={PATH}", "PYTHONDONTWRITEBYTECODE=1"],
        "Cmd": ["carve-controller", "--help"],
        "WorkingDir": "/",
    }
    archive = oci_archive(args.name, layers, config)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(".tmp")
    partial.write_bytes(archive)
    partial.replace(output)
    gzipped = sum(len(gzip.compress(layer, compresslevel=6)) for layer in layers)
    mib = 1024 * 1024
    sizes = " + ".join(f"{len(layer) / mib:.1f}" for layer in layers)
    _say(
        f"{args.name}: {output} ({len(archive) / mib:.1f} MiB; layers {sizes} MiB, "
        f"{gzipped / mib:.1f} MiB gzipped as a registry stores it)"
    )
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
