"""The real helm (hack/helm/build.sh) with a configuration of its own, for the chart tests
(tests/deploy/) and the in-cluster install (tests/realnode/test_in_cluster.py): nothing is read
from or written to ~/.config/helm. Where helm cannot be built (no Go), `helm_binary` skips,
with the reason; with CARVE_REQUIRE_CLUSTER set (CI) it fails instead."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "carve"
HELM_BUILD = REPO / "hack" / "helm" / "build.sh"


@dataclass(frozen=True)
class Helm:
    binary: Path
    home: Path

    def run(
        self, *args: str, check: bool = True, kubeconfig: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        env.pop("KUBECONFIG", None)
        if kubeconfig is not None:
            env["KUBECONFIG"] = kubeconfig
        done = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"helm {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}"
            )
        return done

    def template(self, *sets: str, namespace: str = "carve-system") -> list[dict[str, Any]]:
        """The chart's objects with `--set` values."""
        args = ["template", "carve", str(CHART), "--namespace", namespace]
        for s in sets:
            args += ["--set", s]
        return [d for d in yaml.safe_load_all(self.run(*args).stdout) if d]


NOWHERE = {"carve.dev/test-no-such-node": "true"}
"""A nodeSelector no node matches: a parked install's pods are never scheduled."""


@contextlib.contextmanager
def parked_install(
    helm: Helm, kubeconfig: Path, release: str, namespace: str, *sets: str
) -> Iterator[Path]:
    """The chart installed under `release` with its pods scheduled nowhere: its RBAC, admission
    policies and settings are live, none of its components runs (a test runs them itself, or
    needs only what the apiserver enforces). Uninstalled on exit; yields `kubeconfig`."""
    helm.run(
        "install",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--create-namespace",
        *(a for s in sets for a in ("--set", s)),
        "--set-json",
        f"controller.nodeSelector={json.dumps(NOWHERE)}",
        "--set-json",
        f"plugin.nodeSelector={json.dumps(NOWHERE)}",
        kubeconfig=str(kubeconfig),
    )
    try:
        yield kubeconfig
    finally:
        helm.run(
            "uninstall",
            release,
            "--namespace",
            namespace,
            "--wait",
            kubeconfig=str(kubeconfig),
            check=False,
        )


def helm_binary() -> Path:
    go_dirs = os.pathsep.join(("/usr/local/go/bin", os.environ.get("PATH", "")))
    env = {**os.environ, "PATH": go_dirs}
    done = subprocess.run(
        ["bash", str(HELM_BUILD)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode == 0:
        return Path(done.stdout.strip()) / "helm"
    reason = f"helm unavailable (hack/helm/build.sh exit {done.returncode}): {done.stderr[-800:]}"
    if done.returncode == 2 and not os.environ.get("CARVE_REQUIRE_CLUSTER"):
        pytest.skip(reason)
    raise RuntimeError(reason)


def by_kind(docs: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Sequence[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {json.dumps([d['metadata'] for d in found])}"
    return found[0]
