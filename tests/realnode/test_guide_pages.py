"""Pages of docs/guide/ run as a reader would: their files applied and every ``$ kubectl``
line run in order on real nodes, each checked against the output the page shows.
(install.md needs carve installed from its chart: tests/realnode/test_in_cluster.py runs it.)

Three edits only: the image becomes the local test image (no registry here), each pod gets the
node selector of this suite's nodes (the control plane is shared), and the commands run in the
test's namespace, not ``default`` (so kubectl's "deleted from default namespace" says its name).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from devcluster.cluster import run_kubectl
from realnode.images import TEST_IMAGE
from tests.realnode.harness import NODE_H, REAL_GROUP, REAL_GROUP_LABEL, RealEnv
from tests.support.guide import Step, expected_in, read_page, run_step

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide"
# Commands that only read may be asked again until what the page shows has happened.
_READS = {"get", "logs", "describe", "wait"}


def _for_this_suite(text: str) -> str:
    docs = [d for d in yaml.safe_load_all(text) if d]
    pin = {"kubernetes.io/hostname": NODE_H} if "MPS" in text else {}
    for d in docs:
        if d.get("kind") != "Pod":
            continue
        # MPS needs the H100 (its pods share one slice); the other pages use both nodes.
        d["spec"]["nodeSelector"] = {REAL_GROUP_LABEL: REAL_GROUP, **pin}
        for c in d["spec"]["containers"]:
            c["image"] = TEST_IMAGE
            c["imagePullPolicy"] = "IfNotPresent"
    return yaml.safe_dump_all(docs)


def _argv(step: Step, files: Path, namespace: str) -> list[str]:
    argv = shlex.split(step.command)
    assert argv[0] in ("kubectl", "carve"), f"the guide runs only kubectl and carve: {step.command}"
    if argv[0] == "carve":  # carve's CLI reads the API, cluster-wide
        return argv
    out = []
    for i, arg in enumerate(argv[1:], 1):
        out.append(str(files / arg) if argv[i - 1] == "-f" else arg)
    return [*out, "-n", namespace]


def _run(env: RealEnv, step: Step, argv: list[str]) -> str:
    kubeconfig = Path(env.stack.kubeconfig)
    if argv[0] == "carve":
        cli = [sys.executable, "-m", "carvecli.main", *argv[1:], f"--kubeconfig={kubeconfig}"]

        def attempt() -> subprocess.CompletedProcess[str]:
            return subprocess.run(cli, capture_output=True, text=True, timeout=60, check=False)

        namespace, retry = env.namespace, True
    else:

        def attempt() -> subprocess.CompletedProcess[str]:
            return run_kubectl(kubeconfig, *argv, check=False, timeout=120)

        namespace, retry = argv[argv.index("-n") + 1], argv[0] in _READS
    expected = expected_in(step, namespace)
    return run_step(step, attempt, expected, retry=retry, diagnostics=env.diagnostics)


def _run_page(env: RealEnv, tmp_path: Path, page_name: str) -> dict[str, str]:
    page = read_page(GUIDE / page_name)
    assert page.steps, f"{page_name} shows no command"
    for name, text in page.files.items():
        (tmp_path / name).write_text(_for_this_suite(text))
    return {s.command: _run(env, s, _argv(s, tmp_path, env.namespace)) for s in page.steps}


def test_the_mps_page_runs_as_written(env: RealEnv, tmp_path: Path) -> None:
    outputs = _run_page(env, tmp_path, "mps.md")
    assert "client limit: 25" in outputs["kubectl logs mps-a"]
    # What the page says in prose: one slice carried both pods; none is left.
    env.wait_no_instances(timeout=60)


def test_the_profiles_page_runs_as_written(env: RealEnv, tmp_path: Path) -> None:
    outputs = _run_page(env, tmp_path, "profiles.md")
    assert "3g.40gb" in outputs["kubectl logs by-profile"]
    env.wait_no_instances(timeout=90)
