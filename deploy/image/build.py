"""Build carve's image without any registry: an OCI archive made from Debian's packages.

    python deploy/image/build.py [--output FILE] [--name REF] [--mirror URL]

The same recipe as deploy/Dockerfile, by other means: Debian bookworm with the packages in
deploy/image/debian-packages (here made by `mmdebstrap`, there by `debian:bookworm-slim`), this
project's wheel and its dependencies from PyPI installed with pip into
/usr/local/lib/python3.11/dist-packages, their console scripts in /usr/local/bin, the user
carve (65532), and `carve-controller --help` as the command. The Deployment and the DaemonSet
name the entry point (deploy/helm/carve).

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
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from realnode.images import _oci_archive  # noqa: E402  (the OCI layout writer)

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


def python_tree(work: Path) -> tuple[Path, Path]:
    """The wheel of this project and its dependencies installed for the image's Python:
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
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check")
    _run(*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(work / "wheels"), str(src))
    [wheel] = (work / "wheels").glob("carve_dra-*.whl")
    stage = work / "stage"
    only_wheels = ("--no-compile", "--only-binary=:all:")
    _run(*pip, "install", "--quiet", *only_wheels, "--target", str(stage), str(wheel))
    scripts = work / "scripts"
    (stage / "bin").rename(scripts)
    for script in scripts.iterdir():  # pip wrote this interpreter's path; the image has its own
        lines = script.read_bytes().split(b"\n", 1)
        if lines[0].startswith(b"#!"):
            script.write_bytes(f"#!{PYTHON}".encode() + b"\n" + lines[1])
    missing = [e for e in ENTRY_POINTS if not (scripts / e).is_file()]
    if missing:
        raise SystemExit(f"the wheel has no console scripts {missing}")
    # Byte code that does not depend on file times (the root file system is read-only).
    unchecked = ("--invalidation-mode", "unchecked-hash")
    _run(sys.executable, "-m", "compileall", "-q", "-j0", *unchecked, str(stage))
    return stage, scripts


def root_filesystem(work: Path, stage: Path, scripts: Path, mirror: str) -> Path:
    """mmdebstrap's tarball of the image's root file system (the image's one layer)."""
    out = work / "rootfs.tar"
    as_carve = 'chroot --userspec=65532:65532 "$1"'
    smoke = " && ".join(
        [f"{as_carve} /usr/local/bin/{e} --help >/dev/null" for e in ENTRY_POINTS]
        + [f"{as_carve} {PYTHON} -c '{IMPORT_ALL}'"]
    )
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
        f"--customize-hook=sync-in {stage} {SITE_PACKAGES}",
        f"--customize-hook=sync-in {scripts} /usr/local/bin",
        f"--customize-hook=echo '{USER}' >> \"$1/etc/passwd\"",
        f"--customize-hook=echo '{GROUP}' >> \"$1/etc/group\"",
        f"--customize-hook={smoke}",
        '--customize-hook=rm -rf "$1/var/log/"*.log "$1/var/cache/debconf/"*-old',
        SUITE,
        str(out),
        f"deb {mirror} {SUITE} main",
        f"deb {mirror} {SUITE}-updates main",
        f"deb {security} {SUITE}-security main",
    ]
    env = dict(os.environ)
    last_commit = ["git", "-C", str(REPO), "log", "-1", "--format=%ct"]
    epoch = subprocess.run(last_commit, capture_output=True, text=True, check=False).stdout.strip()
    if epoch:
        env["SOURCE_DATE_EPOCH"] = epoch  # file times in the tarball: the last commit's
    _run(*command, env=env)
    return out


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
    with tempfile.TemporaryDirectory(prefix="carve-image-") as tmp:
        work = Path(tmp)
        _say("installing the wheel and its dependencies")
        stage, scripts = python_tree(work)
        _say(f"making Debian {SUITE} with {', '.join(packages())} (mmdebstrap)")
        layer = root_filesystem(work, stage, scripts, args.mirror).read_bytes()
    config = {
        "User": "65532",
        "Env": [f"PATH={PATH}", "PYTHONDONTWRITEBYTECODE=1"],
        "Cmd": ["carve-controller", "--help"],
        "WorkingDir": "/",
    }
    archive = _oci_archive(args.name, layer, config)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(archive)
    gzipped = len(gzip.compress(layer, compresslevel=6))
    mib = 1024 * 1024
    _say(
        f"{args.name}: {output} ({len(archive) / mib:.1f} MiB; root file system "
        f"{len(layer) / mib:.1f} MiB, {gzipped / mib:.1f} MiB gzipped as a registry stores it)"
    )
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
