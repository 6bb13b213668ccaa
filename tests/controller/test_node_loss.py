"""Lost nodes: the reconciler, with the real placement engine, fed informer events.

A node is lost when its Node object is deleted, when it carries the taint
node.kubernetes.io/out-of-service, or when it has been NotReady longer than the grace. The tests
play the kubelet plugin (node finalizer), kube-scheduler (binding) and kube-controller-manager
(PodGC, reservedFor) by hand, and check what the controller does: which finalizer goes, which
allocation is cleared, which events say so, and that a freed placement is given out again only
where it is safe.
"""

from __future__ import annotations

import copy
import datetime as dt
import itertools
from typing import Any

import pytest

from controller.cache import trim_node
from controller.config import ReconcilerConfig
from controller.main import parse_options
from controller.nodefit import MisfitReason, PodNeeds, check_node, parse_node
from controller.nodehealth.signals import LossSignal, node_loss
from controller.objects import EventType, Kind
from controller.planner import EnginePlanner
from controller.reconciler import Reconciler
from controller.tolerations import Toleration
from driver.apiobject import Obj
from driver.apiviews import ClaimView
from driver.contract import DEFAULT_CONTRACT
from process.flags import UsageError
from tests.support.engine_cluster import device_class, node, profile_claim, slices
from tests.support.reconciler import ListRecorder, MemoryWriter, pod

A100 = "A100-SXM4-40GB"
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
OOS = "node.kubernetes.io/out-of-service"
ALLOC_FIN = DEFAULT_CONTRACT.allocation_finalizer


class Cluster:
    """Reconciler + engine + in-memory API with a settable wall clock."""

    def __init__(self, nodes: dict[str, list[str]], grace: float | None = 60.0) -> None:
        self.wall = [T0]
        self.planner = EnginePlanner("mig.carve.dev")
        self.writer = MemoryWriter()
        self.recorder = ListRecorder()
        self.rec = Reconciler(
            self.planner,
            self.writer,
            self.recorder,
            config=ReconcilerConfig(node_loss_grace=grace),
            wall_clock=lambda: self.wall[0],
        )
        for k in Kind:
            self.rec.mark_synced(k)
        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("mig.carve.dev", "mig"))
        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("gpu.carve.dev", "gpu"))
        self.nodes: dict[str, Obj] = {}
        for n, models in nodes.items():
            self.add_node(n, models)
        self._seq = itertools.count()

    def add_node(self, name: str, models: list[str] | None = None) -> None:
        self.nodes[name] = node(name)
        self.rec.enqueue(Kind.NODE, EventType.ADDED, copy.deepcopy(self.nodes[name]))
        for s in slices(name, models or []):
            self.rec.enqueue(Kind.SLICE, EventType.ADDED, s)

    def change_node(self, name: str, **fields: Any) -> None:
        n = self.nodes[name]
        if "taints" in fields:
            n["spec"]["taints"] = fields["taints"]
        if "ready" in fields:
            n["status"]["conditions"] = [
                {
                    "type": "Ready",
                    "status": fields["ready"],
                    "lastTransitionTime": self.wall[0].isoformat().replace("+00:00", "Z"),
                }
            ]
        n["metadata"]["resourceVersion"] = str(int(n["metadata"]["resourceVersion"]) + 1)
        self.rec.enqueue(Kind.NODE, EventType.MODIFIED, copy.deepcopy(n))

    def delete_node(self, name: str) -> None:
        self.rec.enqueue(Kind.NODE, EventType.DELETED, self.nodes.pop(name))

    def submit(self, claim_name: str, profile: str = "2g.10gb", *, gated: bool = True) -> str:
        i = next(self._seq)
        self.rec.enqueue(
            Kind.CLAIM, EventType.ADDED, self.writer.put(profile_claim(claim_name, profile))
        )
        name = f"p-{claim_name}"
        p = pod(name, [claim_name], created=f"2026-01-01T00:{i:02d}:00Z", gated=gated)
        self.rec.enqueue(Kind.POD, EventType.ADDED, self.writer.put(p))
        return name

    def bind(self, pod_name: str, claim_name: str, *, prepare: bool = True) -> None:
        """kube-scheduler binds the pod, the kubelet runs it, the plugin prepares the claim."""
        c = self.writer.objects[claim_name]
        target = ClaimView(c).node
        assert target is not None
        p = self.writer.objects[pod_name]
        p["spec"]["nodeName"] = target
        p["status"]["phase"] = "Running"
        self.rec.enqueue(Kind.POD, EventType.MODIFIED, self.writer.put(p))
        c["status"]["reservedFor"] = [
            {"resource": "pods", "name": pod_name, "uid": p["metadata"]["uid"]}
        ]
        if prepare:
            c["metadata"]["finalizers"].append(DEFAULT_CONTRACT.node_finalizer(target))
        self.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, self.writer.put(c))

    def pod_gc(self, pod_name: str) -> None:
        """PodGC force-deletes the pod; kube-controller-manager drops it from reservedFor."""
        p = self.writer.objects.pop(pod_name)
        self.rec.enqueue(Kind.POD, EventType.DELETED, p)
        for c in list(self.writer.objects.values()):
            reserved = c.get("status", {}).get("reservedFor") or []
            if any(r["name"] == pod_name for r in reserved):
                c["status"]["reservedFor"] = [r for r in reserved if r["name"] != pod_name]
                self.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, self.writer.put(c))

    def claim(self, name: str) -> Obj:
        return self.writer.objects[name]

    def node_of(self, claim_name: str) -> str | None:
        return ClaimView(self.claim(claim_name)).node

    def device_of(self, claim_name: str) -> tuple[str, str]:
        [r] = self.claim(claim_name)["status"]["allocation"]["devices"]["results"]
        return r["pool"], r["device"]

    def events(self, name: str, reason: str) -> list[str]:
        return [e[3] for e in self.recorder.events if e[0] == name and e[2] == reason]


def _fill_n1(c: Cluster) -> list[str]:
    """Three 2g.10gb slices placed and running on n1 (the only node at first)."""
    claims = [f"c{i}" for i in range(3)]
    for name in claims:
        c.submit(name)
    c.rec.step()
    for name in claims:
        assert c.node_of(name) == "n1"
        c.bind(f"p-{name}", name)
    c.rec.step()
    return claims


def test_deleted_node_loses_its_finalizers_then_its_placements_once_the_pods_are_gone() -> None:
    c = Cluster({"n1": [A100]})
    claims = _fill_n1(c)
    devices = {name: c.device_of(name) for name in claims}
    c.add_node("n2", [A100])
    c.delete_node("n1")
    c.rec.step()
    fin = DEFAULT_CONTRACT.node_finalizer("n1")
    for name in claims:
        claim = c.claim(name)
        # The node will never remove its finalizer: the controller does, with an event ...
        assert fin not in claim["metadata"]["finalizers"]
        [message] = c.events(name, "NodeLost")
        assert "node n1 is lost (its Node object was deleted)" in message
        assert f"removed the node finalizer {fin}" in message
        # ... but the allocation stays while kube-controller-manager still lists the pod.
        assert c.node_of(name) == "n1" and ALLOC_FIN in claim["metadata"]["finalizers"]

    for name in claims:
        c.pod_gc(f"p-{name}")
    c.rec.step()
    for name in claims:
        claim = c.claim(name)
        assert not claim["status"].get("allocation")
        assert ALLOC_FIN not in claim["metadata"]["finalizers"]
        assert any(
            "allocation cleared, its placement is free" in m for m in c.events(name, "NodeLost")
        )

    # New work goes to n2 while n1 has no Node object ...
    c.submit("new")
    c.rec.step()
    assert c.node_of("new") == "n2"
    # ... and when n1 registers again, its freed placements are given out again.
    c.add_node("n1", [A100])
    for i in range(3):
        c.submit(f"again{i}")
    c.rec.step()
    reused = {c.device_of(f"again{i}") for i in range(3)} & set(devices.values())
    assert reused, "the placements freed on n1 are reusable once n1 is back"
    assert c.planner.model.problems == {}


def test_out_of_service_node_releases_running_claims_and_replans_an_unbound_pod() -> None:
    c = Cluster({"n1": [A100]})
    c.submit("run")
    c.submit("wait", gated=True)
    c.rec.step()
    assert c.node_of("run") == c.node_of("wait") == "n1"
    c.bind("p-run", "run")  # "wait" is ungated but kube-scheduler has not bound it yet
    c.add_node("n2", [A100])
    c.rec.step()
    c.change_node("n1", taints=[{"key": OOS, "value": "nodeshutdown", "effect": "NoExecute"}])
    c.rec.step()

    # The running pod's claim: node finalizer removed although the pod still shows Running.
    run = c.claim("run")
    assert DEFAULT_CONTRACT.node_finalizer("n1") not in run["metadata"]["finalizers"]
    assert any(f"{OOS}:NoExecute" in m for m in c.events("run", "NodeLost"))
    # The unbound pod's claim was cleared and placed again on n2, in the same step.
    assert c.node_of("wait") == "n2"
    assert any("will be placed on another node" in m for m in c.events("wait", "NodeLost"))
    [told] = c.events("p-wait", "NodeLost")
    assert "before this pod was bound there; placing its claims again" in told
    assert not c.events("p-wait", "AllocationCleared")  # not blamed on kube-scheduler
    # Nothing new lands on n1 while it is out of service, even for a pod tolerating everything.
    c.submit("more")
    c.rec.step()
    assert c.node_of("more") == "n2"
    n1 = parse_node(c.nodes["n1"])
    everything = PodNeeds(tolerations=(Toleration("", "Exists", "", ""),))
    misfit = check_node(everything, n1, n1.allocatable - n1.allocatable)
    assert misfit is not None and misfit.reason is MisfitReason.OUT_OF_SERVICE


def test_not_ready_past_the_grace_replans_unbound_claims_but_keeps_prepared_ones() -> None:
    c = Cluster({"n1": [A100], "n2": [A100]}, grace=60.0)
    c.submit("run")
    c.rec.step()
    target = c.node_of("run")
    other = "n2" if target == "n1" else "n1"
    c.bind("p-run", "run")
    # A gated pod whose claim is already allocated on the node (a controller restarted between
    # the allocation and the gate removal).
    c.submit("gated")
    c.rec.step()
    assert c.node_of("gated") == target
    fresh = c.writer.objects["p-gated"]
    fresh["spec"]["schedulingGates"] = [{"name": DEFAULT_CONTRACT.scheduling_gate}]
    c.rec.enqueue(Kind.POD, EventType.MODIFIED, c.writer.put(fresh))
    c.change_node(target, ready="Unknown")
    c.rec.step()
    assert c.node_of("gated") == target  # within the grace: nothing happens
    assert not c.events("run", "NodeLost")

    c.wall[0] += dt.timedelta(seconds=62)
    c.rec.step()
    assert c.node_of("gated") == other  # re-planned elsewhere
    run = c.claim("run")
    # The prepared claim keeps its node finalizer and placement: the node may still run it.
    assert DEFAULT_CONTRACT.node_finalizer(target) in run["metadata"]["finalizers"]
    assert c.node_of("run") == target
    [message] = c.events("run", "NodeLost")
    assert "longer than --node-loss-grace=60s" in message
    assert "keeps its placement while pod ns/p-run may still run there" in message
    # Even once the pod is deleted, NotReady alone never frees the instance.
    c.pod_gc("p-run")
    c.rec.step()
    assert DEFAULT_CONTRACT.node_finalizer(target) in c.claim("run")["metadata"]["finalizers"]
    assert c.node_of("run") == target
    assert (
        "until the node is Ready again, is deleted, or is tainted"
        in c.events("run", "NodeLost")[-1]
    )
    # The node comes back and confirms teardown itself: the ordinary release follows.
    c.change_node(target, ready="True")
    claim = c.claim("run")
    claim["metadata"]["finalizers"].remove(DEFAULT_CONTRACT.node_finalizer(target))
    c.rec.enqueue(Kind.CLAIM, EventType.MODIFIED, c.writer.put(claim))
    c.rec.step()
    assert not c.claim("run")["status"].get("allocation")
    assert not c.events("run", "Released"), "a release is told by the claim's status alone"


def test_grace_zero_turns_the_not_ready_signal_off() -> None:
    c = Cluster({"n1": [A100]}, grace=None)
    c.submit("a")
    c.rec.step()
    c.change_node("n1", ready="False")
    c.wall[0] += dt.timedelta(days=1)
    c.rec.step()
    assert c.node_of("a") == "n1" and not c.events("a", "NodeLost")


def test_loss_signals_and_their_messages() -> None:
    ready = node("n")
    assert node_loss("n", ready, T0, 60) is None
    deleted = node_loss("n", None, T0, 60)
    assert deleted is not None and deleted.signal is LossSignal.DELETED and deleted.strong
    tainted = copy.deepcopy(ready)
    tainted["spec"]["taints"] = [{"key": OOS, "effect": "NoSchedule"}]
    oos = node_loss("n", tainted, T0, None)
    assert oos is not None and oos.signal is LossSignal.OUT_OF_SERVICE
    assert oos.describe() == f"node n is lost (it carries the taint {OOS}:NoSchedule)"
    down = copy.deepcopy(ready)
    down["status"]["conditions"] = [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    ]
    assert node_loss("n", down, T0 + dt.timedelta(seconds=60), 60) is None
    late = node_loss("n", down, T0 + dt.timedelta(seconds=61), 60)
    assert late is not None and late.signal is LossSignal.NOT_READY and not late.strong
    assert node_loss("n", down, T0 + dt.timedelta(days=9), None) is None
    # No transition time: carve does not guess how long the node has been down.
    down["status"]["conditions"][0].pop("lastTransitionTime")
    assert node_loss("n", down, T0 + dt.timedelta(days=9), 60) is None


def test_nodes_are_kept_trimmed() -> None:
    big = node("n")
    big["status"]["images"] = [{"names": ["x"] * 50, "sizeBytes": 1}]
    big["status"]["conditions"][0]["message"] = "kubelet is posting ready status" * 20
    big["metadata"]["managedFields"] = [{"manager": "kubelet"}]
    small = trim_node(big)
    assert "images" not in small["status"] and "managedFields" not in small["metadata"]
    assert small["metadata"]["resourceVersion"] == "1"
    assert parse_node(small) == parse_node(big)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("5m", 300.0), ("90s", 90.0), ("0", None), ("0s", None)],
)
def test_node_loss_grace_flag(value: str, expected: float | None) -> None:
    assert parse_options([f"--node-loss-grace={value}"], {}).node_loss_grace == expected
    assert parse_options([], {"CARVE_NODE_LOSS_GRACE": value}).node_loss_grace == expected


def test_node_loss_grace_defaults_to_five_minutes() -> None:
    assert parse_options([], {}).node_loss_grace == 300.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-5m", "--node-loss-grace='-5m': must be 0 (signal off) or a positive duration"),
        ("soon", "--node-loss-grace='soon': not a duration (250ms, 30s, 5m or 1.5h)"),
        ("5 minutes", "--node-loss-grace='5 minutes': not a duration"),
        ("", "--node-loss-grace: not a duration"),
    ],
)
def test_bad_node_loss_grace_gives_a_specific_message(value: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_options([f"--node-loss-grace={value}"], {})
    assert message in str(err.value)
    assert "e.g. --node-loss-grace=5m" in str(err.value)
