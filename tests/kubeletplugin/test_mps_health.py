"""A claim's MPS daemon found dead shows in the kubelet's health stream and the claim's events
(issue 16, build point 2): the claim's devices are unhealthy from the moment housekeeping finds
the daemon dead until a later check finds the restarted one answering, and each restart (or
failed restart) posts a Warning Event on the ResourceClaim."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from driver.cdi import CdiWriter
from driver.driverroot import discover
from driver.nvml import sim
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.claims import KubernetesClaimEvents
from kubeletplugin.mps import MpsControl, _alive, find_binary
from kubeletplugin.nodehardware import NodeHardware
from kubeletplugin.prepare import Preparer, PreparerSettings
from process.kube.errors import api_error
from process.kube.jsonclient import KubeJson
from tests.kubeletplugin.node_harness import (
    DRIVER,
    NODE,
    FakeKubeJson,
    Node,
    mig,
    mps_config,
    open_node,
)

H100 = "H100-SXM5-80GB"
EVENTS_PATH = "/apis/events.k8s.io/v1/namespaces/default/events"


class Env:
    def __init__(self, node: Node, tmp_path: Path) -> None:
        self.node = node
        self.api = FakeKubeJson()
        files = discover(
            tmp_path / "driver", version=node.backend.gpus()[0].driver_version, hook_dirs=()
        )
        self.mps = MpsControl(
            find_binary(tmp_path / "driver"), tmp_path / "plugins" / DRIVER / "mps", timeout=30
        )
        self.p = Preparer(
            settings=PreparerSettings(DRIVER, NODE, NODE),
            backend=node.backend,
            claims=node.claims,
            store=CheckpointStore(node.checkpoint_dir),
            cdi=CdiWriter(node.cdi_root, vendor=DRIVER),
            shared_edits=files.spec_edits(),
            dev_root=tmp_path / "devroot",
            mps=self.mps,
            events=KubernetesClaimEvents(cast(KubeJson, self.api), driver=DRIVER, node=NODE),
        )
        node.preparer = self.p
        self.p.reconcile()
        self.health = NodeHardware(node.backend, sim.sim_proc_root()).health_source(
            DRIVER, NODE, self.p.refused_gpus, self.p.mps_down_devices
        )

    def health_of(self, device: str) -> tuple[bool, str]:
        (entry,) = [(ok, why) for _, name, ok, why in self.health() if name == device]
        return entry

    def events(self) -> list[dict[str, Any]]:
        return [body for method, path, body in self.api.requests if path == EVENTS_PATH]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    n = open_node(tmp_path, [H100])
    sim.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    e = Env(n, tmp_path)
    yield e
    for rec in e.p.checkpoint().claims.values():  # never leave a daemon behind a failed test
        if rec.mps is not None and rec.mps.pid is not None and _alive(rec.mps.pid):
            os.kill(rec.mps.pid, signal.SIGKILL)
    e.p.close()
    n.backend.close()
    sim.configure(None)


def _kill(pid: int | None) -> None:
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_dead_daemon_is_unhealthy_and_an_event_until_the_restarted_one_answers(
    env: Env,
) -> None:
    dev = mig(env.node.backend, 0, 19, 3)
    other = mig(env.node.backend, 0, 19, 0)
    ref = env.node.claims.add("shared", [dev], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    assert env.health_of(dev) == (True, "")
    env.p.retry_pending()  # an answering daemon: nothing to say
    assert env.health_of(dev) == (True, "")
    assert env.events() == []

    first = env.p.checkpoint().claims[ref.uid].mps
    assert first is not None
    _kill(first.pid)
    env.p.retry_pending()  # housekeeping finds it dead and restarts it

    ok, why = env.health_of(dev)
    assert not ok
    assert why == "MPS control daemon of claim default/shared is down (restarting)"
    assert env.health_of(other) == (True, "")  # only the claim's devices
    assert env.p.metrics.errors.labels(operation="reconcile", reason="mps-down")._value.get() == 1
    (event,) = env.events()
    assert event["reason"] == "MPSDaemonRestarted"
    assert event["type"] == "Warning"
    assert event["reportingController"] == f"{DRIVER}/kubelet-plugin"
    assert event["regarding"] == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "namespace": "default",
        "name": "shared",
        "uid": ref.uid,
    }
    assert NODE in event["note"]
    assert event["metadata"]["namespace"] == "default"

    again = env.p.checkpoint().claims[ref.uid].mps
    assert again is not None and again.pid not in (None, first.pid) and _alive(again.pid)
    env.p.retry_pending()  # the restarted daemon answers: healthy again, no new event
    assert env.health_of(dev) == (True, "")
    assert len(env.events()) == 1

    assert env.p.unprepare([ref])[ref.uid] == ""


def test_a_failed_restart_stays_down_and_says_so(env: Env, tmp_path: Path) -> None:
    dev = mig(env.node.backend, 0, 19, 1)
    ref = env.node.claims.add("c", [dev], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    rec = env.p.checkpoint().claims[ref.uid]
    assert rec.mps is not None
    _kill(rec.mps.pid)

    binary = env.mps.binary
    env.mps.binary = Path("/bin/false")  # `-d` fails
    env.p.retry_pending()
    ok, why = env.health_of(dev)
    assert not ok
    assert why.startswith("MPS control daemon of claim default/c is down (restart failed: ")
    (event,) = env.events()
    assert event["reason"] == "MPSDaemonDown"
    assert "could not be restarted" in event["note"]

    env.mps.binary = binary
    env.p.retry_pending()  # restarted now
    assert env.health_of(dev) == (
        False,
        "MPS control daemon of claim default/c is down (restarting)",
    )
    assert [e["reason"] for e in env.events()] == ["MPSDaemonDown", "MPSDaemonRestarted"]
    env.p.retry_pending()
    assert env.health_of(dev) == (True, "")
    assert env.p.unprepare([ref])[ref.uid] == ""


def test_start_up_finding_the_daemon_dead_says_so_too(env: Env, tmp_path: Path) -> None:
    dev = mig(env.node.backend, 0, 19, 2)
    ref = env.node.claims.add("c", [dev], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    rec = env.p.checkpoint().claims[ref.uid]
    assert rec.mps is not None
    _kill(rec.mps.pid)
    env.p.close()
    fresh = Env(env.node, tmp_path)  # a new plugin process: start-up reconcile restarts it
    env.p, env.api, env.health, env.mps = fresh.p, fresh.api, fresh.health, fresh.mps
    assert not fresh.health_of(dev)[0]
    (event,) = fresh.events()
    assert event["reason"] == "MPSDaemonRestarted"
    assert "start-up" in event["note"]
    # Unprepared while marked: the mark goes with the claim.
    assert fresh.p.unprepare([ref])[ref.uid] == ""
    assert fresh.p.mps_down_devices() == {}
    assert fresh.health_of(dev) == (True, "")


def test_an_event_that_cannot_be_posted_is_logged_not_fatal(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    dev = mig(env.node.backend, 0, 19, 4)
    ref = env.node.claims.add("c", [dev], config=mps_config())
    assert env.p.prepare([ref])[ref.uid].error == ""
    rec = env.p.checkpoint().claims[ref.uid]
    assert rec.mps is not None
    _kill(rec.mps.pid)
    env.api.fail = api_error(403, "events.events.k8s.io is forbidden")
    env.p.retry_pending()
    again = env.p.checkpoint().claims[ref.uid].mps
    assert again is not None and again.pid not in (None, rec.mps.pid) and _alive(again.pid)
    assert not env.health_of(dev)[0]
    assert "could not post event MPSDaemonRestarted on ResourceClaim default/c" in caplog.text
    assert env.p.unprepare([ref])[ref.uid] == ""
