"""`make demo`'s decisions, without a cluster: which nodes it runs on, what it changes in the
examples, and how it follows pods and claims (kubectl and the API are stand-ins here)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import process.kube.jsonclient
from nodesim import __main__ as cli
from nodesim import demo, demowatch
from process.kube.errors import api_error
from realnode import binaries
from realnode.images import TEST_IMAGE

EXAMPLE_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"


def _no_probe() -> Any:
    raise AssertionError("NODES=sim must not look for real-node programs")


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """What realnode.binaries reports: set "why" (why_not_here) and "missing" (what
    ensure_node_binaries raises with); both None means real nodes can run."""
    state: dict[str, Any] = {"why": None, "missing": None, "probed": 0}

    def ensure() -> object:
        state["probed"] += 1
        if state["missing"]:
            raise binaries.NodeBinariesUnavailableError(state["missing"])
        return object()

    monkeypatch.setattr(binaries, "why_not_here", lambda: state["why"])
    monkeypatch.setattr(binaries, "ensure_node_binaries", ensure)
    yield state


# -- which nodes -------------------------------------------------------------------------------


def test_auto_picks_real_nodes_where_they_can_run(machine: dict[str, Any]) -> None:
    kind, line = demo.choose_nodes("auto")
    assert kind == demo.REAL
    assert line.startswith("real nodes (NODES=auto)")
    assert machine["probed"] == 1


def test_auto_falls_back_to_simulated_nodes_and_says_why(machine: dict[str, Any]) -> None:
    machine["why"] = "real nodes need root (containerd mounts overlayfs)"
    kind, line = demo.choose_nodes("auto")
    assert kind == demo.SIM
    assert line == "simulated nodes, because real nodes need root (containerd mounts overlayfs)"
    assert machine["probed"] == 0  # the machine's reason comes first: no build is tried
    assert "\n" not in line


def test_auto_falls_back_when_the_node_programs_are_missing(machine: dict[str, Any]) -> None:
    machine["missing"] = "real-node programs missing: /x/containerd (run `make node-bin`)"
    kind, line = demo.choose_nodes("auto")
    assert kind == demo.SIM
    assert "real-node programs missing: /x/containerd" in line


def test_real_fails_with_the_reason(machine: dict[str, Any]) -> None:
    machine["why"] = "real nodes need Linux (this is darwin)"
    with pytest.raises(demo.NodesUnavailableError, match=r"NODES=real, but .*need Linux"):
        demo.choose_nodes("real")
    machine["why"] = None
    machine["missing"] = "hack/node/build.sh failed with exit code 1"
    with pytest.raises(demo.NodesUnavailableError, match=r"build\.sh failed"):
        demo.choose_nodes("real")


def test_real_where_real_nodes_can_run(machine: dict[str, Any]) -> None:
    assert demo.choose_nodes("real")[0] == demo.REAL


def test_sim_is_forced_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binaries, "why_not_here", _no_probe)
    monkeypatch.setattr(binaries, "ensure_node_binaries", _no_probe)
    kind, line = demo.choose_nodes("sim")
    assert kind == demo.SIM and line.startswith("simulated nodes (NODES=sim")


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match="auto, real, sim"):
        demo.choose_nodes("fake")


def test_run_demo_real_stops_before_starting_anything(
    machine: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    machine["why"] = "the kernel has no overlayfs"
    assert demo.run_demo(tmp_path, nodes="real") == 2
    out = capsys.readouterr().out
    assert "cannot run the demo on real nodes: NODES=real, but the kernel has no overlayfs" in out
    assert "NODES=sim" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no cluster, no node host


def test_build_output_is_kept_back_unless_it_fails(capfd: pytest.CaptureFixture[str]) -> None:
    def build(fail: bool) -> str:
        subprocess.run(
            ["sh", "-c", "echo '[node-build] up to date' >&2"], stderr=sys.stderr, check=True
        )
        if fail:
            raise binaries.NodeBinariesUnavailableError("build.sh failed")
        return "built"

    assert demo._quietly(lambda: build(False)) == "built"
    assert "node-build" not in "".join(capfd.readouterr())
    with pytest.raises(binaries.NodeBinariesUnavailableError):
        demo._quietly(lambda: build(True))
    assert "  [node-build] up to date" in capfd.readouterr().out


def test_cli_passes_nodes_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(demo, "run_demo", lambda root, **kw: seen.update(kw) or 0)
    assert cli.main(["demo", f"--dir={tmp_path}", "--nodes", "sim"]) == 0
    assert seen["nodes"] == "sim"
    assert cli.main(["demo", f"--dir={tmp_path}"]) == 0
    assert seen["nodes"] == "auto"
    with pytest.raises(SystemExit):
        cli.main(["demo", "--nodes", "gpu"])


# -- the examples on real nodes ----------------------------------------------------------------


def _without_image(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for container in (doc.get("spec") or {}).get("containers") or []:
        container.pop("image", None)
        container.pop("imagePullPolicy", None)
    return doc


def test_examples_change_only_their_image() -> None:
    setup, pods = demo._examples()
    original = copy.deepcopy(pods)
    swapped, replaced = demo.with_image([*setup, *pods], TEST_IMAGE)
    assert replaced == {EXAMPLE_IMAGE}
    assert pods == original  # the documents read from deploy/examples are left as they were
    assert swapped[: len(setup)] == setup  # claims and templates untouched
    swapped_pods = swapped[len(setup) :]
    assert [p["metadata"]["name"] for p in swapped_pods] == [p["metadata"]["name"] for p in pods]
    for before, after in zip(pods, swapped_pods, strict=True):
        assert _without_image(after) == _without_image(before)
        for container in after["spec"]["containers"]:
            assert container["image"] == TEST_IMAGE
            assert container["imagePullPolicy"] == "IfNotPresent"
            assert container["command"] == ["nvidia-smi", "-L"]


def test_init_containers_change_too() -> None:
    pod: dict[str, Any] = {
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "initContainers": [{"name": "i", "image": "a"}],
            "containers": [{"name": "m", "image": "b", "imagePullPolicy": "Always"}],
        },
    }
    [out], replaced = demo.with_image([pod], TEST_IMAGE)
    assert replaced == {"a", "b"}
    assert [c["image"] for c in (*out["spec"]["initContainers"], *out["spec"]["containers"])] == [
        TEST_IMAGE,
        TEST_IMAGE,
    ]
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Always"


# -- following pods and claims -----------------------------------------------------------------


def _pod(name: str, phase: str, claim: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeName": "demo-a30",
            "resourceClaims": [{"name": "pair", "resourceClaimTemplateName": "t"}],
        },
        "status": {
            "phase": phase,
            "resourceClaimStatuses": [{"name": "pair", "resourceClaimName": claim}]
            if claim
            else [],
        },
    }


class FakeKubectl:
    """`kubectl get pods -o json` answers from a script of pod lists; describe is counted."""

    def __init__(self, rounds: list[list[dict[str, Any]]]) -> None:
        self.rounds = rounds
        self.described: list[str] = []

    def __call__(self, *args: str, **_: Any) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("get", "pods"):
            items = self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]
            return subprocess.CompletedProcess(args, 0, json.dumps({"items": items}), "")
        if args[:2] == ("describe", "resourceclaim"):
            self.described.append(args[2])
            return subprocess.CompletedProcess(args, 0, f"describe #{len(self.described)}", "")
        raise AssertionError(args)


def test_wait_pods_settles_on_done_or_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _: None)
    kubectl = FakeKubectl(
        [
            [_pod("a", "Pending"), _pod("b", "Pending")],
            [_pod("a", "Running"), _pod("b", "Failed")],
            [_pod("a", "Succeeded"), _pod("b", "Failed")],
        ]
    )
    shown: dict[str, str] = {}
    phases = demowatch.wait_pods(kubectl, ["a", "b"], 10, ("Running", "Succeeded"), shown=shown)
    assert phases == {"a": "Running", "b": "Failed"}
    phases = demowatch.wait_pods(kubectl, ["a", "b"], 10, ("Succeeded",), shown=shown)
    assert phases == {"a": "Succeeded", "b": "Failed"}
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [(w[0], w[1]) for w in lines] == [
        ("a", "Pending"),
        ("b", "Pending"),
        ("a", "Running"),
        ("b", "Failed"),
        ("a", "Succeeded"),  # the second wait shows only what changed
    ]


def test_claim_snapshot_keeps_the_last_allocated_view(monkeypatch: pytest.MonkeyPatch) -> None:
    allocation = {"devices": {"results": [{"request": "a"}, {"request": "b"}]}}
    answers: list[dict[str, Any] | None] = [
        {"metadata": {"resourceVersion": "1"}, "status": {}},  # not allocated yet
        {"metadata": {"resourceVersion": "2"}, "status": {"allocation": allocation}},
        {"metadata": {"resourceVersion": "2"}, "status": {"allocation": allocation}},  # same
        {"metadata": {"resourceVersion": "3"}, "status": {"allocation": allocation}},
        None,  # deleted once its pod completed
        None,
    ]

    class FakeKubeJson:
        def __init__(self, api: Any) -> None:
            pass

        def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
            assert path.endswith("/resourceclaims/pair-same-gpu-pair-x")
            answer = answers.pop(0)
            if answer is None:
                raise api_error(404, "not found")
            return answer

    monkeypatch.setattr(process.kube.jsonclient, "KubeJson", FakeKubeJson)
    kubectl = FakeKubectl([[]])
    snap = demowatch.ClaimSnapshot(kubectl, None, "pair-same-gpu", "pair")
    snap.poll([_pod("pair-same-gpu", "Pending")])  # no claim name yet: nothing asked
    assert snap.claim is None and len(answers) == 6
    for _ in range(5):
        snap.poll([_pod("pair-same-gpu", "Running", "pair-same-gpu-pair-x")])
    assert kubectl.described == ["pair-same-gpu-pair-x", "pair-same-gpu-pair-x"]
    assert snap.text == "describe #2" and snap.devices == 2
    assert snap.describe_now() is None  # gone now: the demo prints the snapshot
    answers.append(None)
    snap.poll([_pod("pair-same-gpu", "Succeeded", "pair-same-gpu-pair-y")])  # a new name
    assert snap.claim == "pair-same-gpu-pair-x" and snap.text == "describe #2"


def test_gib() -> None:
    assert demowatch.gib("24683652Ki") == "23.5Gi"
    assert demowatch.gib("2Gi") == "2.0Gi"
    assert demowatch.gib("1e9") == "1e9"
