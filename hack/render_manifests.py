"""Render deploy/manifests/ from the Helm chart deploy/helm/carve: one source of truth.

    python hack/render_manifests.py          rewrite deploy/manifests/*.yaml
    python hack/render_manifests.py --check  exit 1, with a diff, if they are not what the
                                             chart renders (tests/deploy runs this)

The plain manifests are `helm template` with the chart's default values, in the namespace
carve-system, with `namespace.create=true` (a Helm install leaves the namespace to
`--create-namespace`; `kubectl apply -f deploy/manifests/` needs it in the files). Each chart
template becomes the file of the same name, so 00-namespace.yaml, 10-deviceclasses.yaml and
30-admission-gate.yaml stay where the test tooling (nodesim/stack.py) reads them. The helm
binary comes from hack/helm/build.sh (built from the Go module proxy, cached), or $CARVE_HELM.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "carve"
MANIFESTS = REPO / "deploy" / "manifests"
HELM_BUILD = REPO / "hack" / "helm" / "build.sh"
RELEASE = "carve"
NAMESPACE = "carve-system"
SET = ("namespace.create=true",)
HEADER = (
    "# Rendered from deploy/helm/carve (default values) by hack/render_manifests.py.\n"
    "# Do not edit: change the chart and run `python hack/render_manifests.py`.\n"
)
_SOURCE = re.compile(r"^# Source: [^/]+/templates/(?P<file>[^\n]+)\n", re.M)


def helm_binary() -> Path:
    """$CARVE_HELM, else the cached build (built first when missing or stale)."""
    configured = os.environ.get("CARVE_HELM")
    if configured:
        return Path(configured)
    done = subprocess.run(["bash", str(HELM_BUILD)], stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"hack/helm/build.sh failed (exit {done.returncode}); see above")
    return Path(done.stdout.strip()) / "helm"


def render(helm: Path) -> dict[str, str]:
    """File name -> contents, as the chart renders them."""
    done = subprocess.run(
        [
            str(helm),
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            *(arg for s in SET for arg in ("--set", s)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"helm template failed:\n{done.stderr}")
    files: dict[str, list[str]] = {}
    marks = list(_SOURCE.finditer(done.stdout))
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        end = following.start() if following else len(done.stdout)
        doc = done.stdout[mark.end() : end].strip()
        doc = doc.removesuffix("---").strip()
        if doc:
            files.setdefault(mark["file"], []).append(doc)
    return {name: HEADER + "---\n".join(d + "\n" for d in docs) for name, docs in files.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    wanted = render(helm_binary())
    present = {p.name: p.read_text() for p in sorted(MANIFESTS.glob("*.yaml"))}
    if args.check:
        diff: list[str] = []
        for name in sorted(set(wanted) | set(present)):
            diff += difflib.unified_diff(
                present.get(name, "").splitlines(keepends=True),
                wanted.get(name, "").splitlines(keepends=True),
                f"deploy/manifests/{name}",
                f"rendered from the chart: {name}",
            )
        if diff:
            sys.stdout.writelines(diff)
            print(
                "\ndeploy/manifests/ differs from the chart; run `python hack/render_manifests.py`",
                file=sys.stderr,
            )
            return 1
        return 0
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    for name in set(present) - set(wanted):
        (MANIFESTS / name).unlink()
    for name, text in wanted.items():
        if present.get(name) != text:
            (MANIFESTS / name).write_text(text)
    print(f"deploy/manifests/: {len(wanted)} files rendered from {CHART.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
