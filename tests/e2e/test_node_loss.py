"""A GPU node is lost and comes back (issue 11, "Node loss"), on the real control plane with the
real carve-controller and real carve-kubelet-plugin processes.

Node A runs three pods of a Deployment (one 1g slice each) and holds the allocation of a fourth
pod that no scheduler ever binds (its ``schedulerName`` names no scheduler), so that claim is
allocated on A but never prepared. Then A dies: kubelet side stopped, plugin killed, heartbeat
gone, and its Node object deleted (or, in the second test, tainted
``node.kubernetes.io/out-of-service``). The controller must give A's claims up (node finalizer
removed, `NodeLost` events), place the unbound pod again on B, free the old claims once their
pods are force-deleted (as PodGC does) and place the replacements on B, without ever handing a
placement out twice. When A comes back with its old GPU state, its plugin destroys the stale
instances before it publishes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pytest
from kubernetes.client.exceptions import ApiException

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.apiviews import ClaimView
from nodesim.simnode import SimNode
from tests.e2e.harness import E2E, cel, request

pytestmark = pytest.mark.cluster

T = TypeVar("T")
A100 = "A100-SXM4-40GB"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


def _deployment(e2e: E2E, name: str, replicas: int) -> None:
    pod = e2e.pod_manifest("unused", {"mig": {"resourceClaimTemplateName": "one-1g"}})
    labels = {"app": name}
    e2e.apps.create_namespaced_deployment(
        e2e.namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {**pod["spec"], "restartPolicy": "Always"},
                },
            },
        },
    )


def _pods(e2e: E2E, app: str) -> list[Any]:
    return list(e2e.core.list_namespaced_pod(e2e.namespace, label_selector=f"app={app}").items)


def _running_on(e2e: E2E, app: str, node: str) -> list[str]:
    return sorted(
        p.metadata.name
        for p in _pods(e2e, app)
        if p.status.phase == "Running"
        and p.spec.node_name == node
        and not p.metadata.deletion_timestamp
    )


def _claim(e2e: E2E, name: str) -> Obj | None:
    for claim in e2e.claims():
        if claim["metadata"]["name"] == name:
            return claim
    return None


def _slices(e2e: E2E, node: SimNode) -> list[Obj]:
    resp = e2e.resource.list_resource_slice(
        field_selector=f"spec.nodeName={node.name}", _preload_content=False
    )
    items: list[Obj] = json.loads(resp.data)["items"]
    return items


def _node_lost_events(e2e: E2E, kind: str, name: str) -> list[str]:
    return [str(e["message"]) for e in e2e.events(kind, name) if e["reason"] == "NodeLost"]


def _until_node_lost_event(
    watch: _Watch, e2e: E2E, kind: str, name: str, text: Callable[[str], bool]
) -> None:
    """Events are written after the change they report, by their own writer: wait for one."""
    watch.until(
        f"NodeLost event on {kind} {name}",
        lambda: any(text(m) for m in _node_lost_events(e2e, kind, name)),
        timeout=15,
    )


def _until_freed_and_deleted(watch: _Watch, e2e: E2E, claims: Sequence[str]) -> None:
    """The lost node's claims deleted, each having said that its placement is free."""
    watch.until(
        "the old claims freed and deleted",
        lambda: all(_claim(e2e, name) is None for name in claims),
        timeout=60,
    )
    for name in claims:
        _until_node_lost_event(
            watch,
            e2e,
            "ResourceClaim",
            name,
            lambda m: "allocation cleared, its placement is free" in m,
        )


def _force_delete(e2e: E2E, names: Sequence[str]) -> None:
    """What PodGC does to the pods of a deleted node, or to the terminating pods of an
    out-of-service one: delete with grace 0, no kubelet confirmation."""
    for name in names:
        try:
            e2e.core.delete_namespaced_pod(name, e2e.namespace, grace_period_seconds=0)
        except ApiException as exc:
            if exc.status != 404:  # PodGC was first
                raise


class _Watch:
    """The invariants checked all along (a background thread, and every poll of a wait), and a
    log of when each step was reached. ``lost`` names the nodes that are down: their stale
    instances are expected until they come back."""

    def __init__(self, e2e: E2E) -> None:
        self.e2e = e2e
        self.lost: tuple[SimNode, ...] = ()
        self.begin = time.monotonic()
        self.last = self.begin
        self.steps: list[str] = []
        self.checks = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariants", daemon=True)
        self._thread.start()

    def _check(self) -> list[str]:
        problems = self.e2e.check_invariants(lost=self.lost)
        self.checks += 1
        self.violations.extend(problems)
        return problems

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self._check()
            except Exception as exc:  # an API hiccup is not a violation
                print(f"checker: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def until(self, what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
        def checked() -> T | None:
            problems = self._check()
            assert problems == [], "\n".join(problems)
            return probe()

        try:
            value = wait_for(what, checked, timeout, interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.e2e.diagnostics()}") from None
        self.mark(what)
        return value

    def mark(self, what: str) -> None:
        now = time.monotonic()
        self.steps.append(f"{now - self.begin:6.1f}s (+{now - self.last:4.1f}s) {what}")
        self.last = now

    def report(self) -> None:
        self.stop()
        assert self.violations == [], "\n".join(self.violations[:20])
        print(f"\nnode loss timeline ({self.checks} invariant checks, none violated):")
        print("\n".join(self.steps))


@pytest.fixture
def watch(e2e: E2E) -> Iterator[_Watch]:
    w = _Watch(e2e)
    try:
        yield w
    finally:
        w.stop()


def _fill_a(e2e: E2E, watch: _Watch, replicas: int, *, waiting: bool) -> tuple[SimNode, SimNode]:
    """Node A with ``replicas`` running pods (and a claim allocated there whose pod is never
    bound), then node B: everything is on A because B did not exist yet."""
    a = e2e.node("a", A100)
    e2e.template(
        "one-1g", [request("mig", [cel('device.attributes["mig.carve.dev"].profile == "1g.5gb"')])]
    )
    _deployment(e2e, "work", replicas)
    if waiting:
        manifest = e2e.pod_manifest("waiting", {"mig": {"resourceClaimTemplateName": "one-1g"}})
        manifest["spec"]["schedulerName"] = "no-such-scheduler"
        e2e.core.create_namespaced_pod(e2e.namespace, manifest)
    watch.until(
        f"{replicas} pods running on A", lambda: len(_running_on(e2e, "work", a.name)) == replicas
    )
    if waiting:

        def waiting_allocated_on_a() -> bool:
            pod = e2e.raw_pod("waiting")
            if pod is None or pod["spec"].get("schedulingGates"):
                return False
            try:
                return ClaimView(e2e.claim_of("waiting", "mig")).node == a.name
            except AssertionError:  # no claim yet
                return False

        watch.until("the unbound pod's claim allocated on A, gate removed", waiting_allocated_on_a)
    assert len(a.hardware_view().instances) == replicas
    b = e2e.node("b", A100)
    watch.mark("node B up")
    return a, b


def test_a_deleted_node_gives_its_claims_up_and_its_stale_instances_die_when_it_returns(
    e2e: E2E, watch: _Watch
) -> None:
    a, b = _fill_a(e2e, watch, 3, waiting=True)
    node_fin = e2e.stack.contract.node_finalizer(a.name)
    on_a = _running_on(e2e, "work", a.name)
    claims_a = [e2e.claim_of(p, "mig")["metadata"]["name"] for p in on_a]
    waiting_claim = e2e.claim_of("waiting", "mig")["metadata"]["name"]
    for name in claims_a:
        claim = _claim(e2e, name)
        assert claim is not None and node_fin in claim["metadata"].get("finalizers", [])
    unprepared = _claim(e2e, waiting_claim)
    assert unprepared is not None
    assert node_fin not in unprepared["metadata"].get("finalizers", [])  # never prepared
    assert e2e.check_invariants() == []

    # A dies and its Node object is deleted.
    watch.lost = (a,)
    a.lose(delete=True)
    watch.mark("node A lost: plugin killed, heartbeat stopped, Node deleted")

    def finalizers_gone() -> bool:
        for name in claims_a:
            claim = _claim(e2e, name)
            if claim is not None and node_fin in claim["metadata"].get("finalizers", []):
                return False
        return True

    watch.until(f"{node_fin} removed from A's prepared claims", finalizers_gone, timeout=30)
    for name in claims_a:
        _until_node_lost_event(
            watch,
            e2e,
            "ResourceClaim",
            name,
            lambda m: (
                "its Node object was deleted" in m and f"removed the node finalizer {node_fin}" in m
            ),
        )
        # Its pod is still bound to A (until PodGC): the claim stays reserved and allocated.
        claim = _claim(e2e, name)
        assert claim is not None and ClaimView(claim).node == a.name

    watch.until(
        "the unbound pod's claim placed again, on B",
        lambda: ClaimView(e2e.claim_of("waiting", "mig")).node == b.name,
        timeout=30,
    )
    assert e2e.claim_of("waiting", "mig")["metadata"]["name"] == waiting_claim
    _until_node_lost_event(
        watch, e2e, "ResourceClaim", waiting_claim, lambda m: "allocation cleared" in m
    )
    _until_node_lost_event(
        watch,
        e2e,
        "Pod",
        "waiting",
        lambda m: a.name in m and "before this pod was bound there" in m,
    )

    # PodGC's part: the pods of the deleted node go; their claims are freed, replacements on B.
    _force_delete(e2e, on_a)
    watch.mark("A's pods force-deleted")
    watch.until(
        "3 replacement pods running on B",
        lambda: len(_running_on(e2e, "work", b.name)) == 3,
        timeout=90,
    )
    _until_freed_and_deleted(watch, e2e, claims_a)
    stale = a.hardware_view().instances
    assert len(stale) == 3  # A is off: its instances are still there
    assert len(b.hardware_view().instances) == 3  # "waiting" is allocated on B, never prepared
    watch.until("A's ResourceSlices garbage-collected with its Node", lambda: not _slices(e2e, a))

    # A boots again with its old GPU state: the plugin destroys the stale instances first.
    log_before = len(a.plugin_log.read_bytes())
    a.come_back()
    watch.mark("node A back: Node re-created, plugin registered")
    # Registration waits only for the reconcile; the release of claims gone from the API
    # follows it, before the node's devices are published (docs/kubeletplugin.md): until
    # then A's stale instances are still expected.
    watch.until("A's stale instances destroyed", lambda: a.hardware_view().instances == ())
    watch.lost = ()
    uid = e2e.core.read_node(a.name).metadata.uid
    watch.until(
        "A's ResourceSlices published again, owned by the new Node",
        lambda: (
            (sl := _slices(e2e, a))
            and all(o["uid"] == uid for s in sl for o in s["metadata"]["ownerReferences"])
        ),
    )
    assert a.hardware_view().instances == ()
    log = a.plugin_log.read_bytes()[log_before:].decode()
    released = [i for i, line in enumerate(log.splitlines()) if "releasing claim that" in line]
    published = [i for i, line in enumerate(log.splitlines()) if "ResourceSlices published" in line]
    assert len(released) == 3 and published, log[-3000:]
    assert max(released) < min(published), "stale instances released only after publishing"
    assert e2e.check_invariants() == []

    # The freed placements are A's again: seven pods pinned there fill it, so the slots that
    # the stale instances held are carved afresh.
    for i in range(7):
        manifest = e2e.pod_manifest(f"again-{i}", {"mig": {"resourceClaimTemplateName": "one-1g"}})
        manifest["spec"]["nodeSelector"]["kubernetes.io/hostname"] = a.name
        e2e.core.create_namespaced_pod(e2e.namespace, manifest)
    for i in range(7):
        e2e.wait_phase(f"again-{i}", "Running")
    watch.mark("7 new pods running on A, filling it")
    assert len(a.hardware_view().instances) == 7
    assert set(stale) <= set(a.hardware_view().instances)
    e2e.delete_pod("waiting")
    e2e.wait_gone("waiting")
    watch.until("the waiting claim released", lambda: _claim(e2e, waiting_claim) is None, 60)
    assert e2e.check_at_rest() == []
    watch.report()


def test_an_out_of_service_node_gives_its_claims_up(e2e: E2E, watch: _Watch) -> None:
    a, b = _fill_a(e2e, watch, 2, waiting=False)
    node_fin = e2e.stack.contract.node_finalizer(a.name)
    on_a = _running_on(e2e, "work", a.name)
    claims_a = [e2e.claim_of(p, "mig")["metadata"]["name"] for p in on_a]

    # A shuts down without draining; an admin asserts so with the out-of-service taint.
    watch.lost = (a,)
    a.lose(delete=False)
    taint = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}
    e2e.core.patch_node(a.name, {"spec": {"taints": [taint]}})
    watch.mark("node A shut down and tainted out-of-service")

    def finalizers_gone() -> bool:
        for name in claims_a:
            claim = _claim(e2e, name)
            if claim is not None and node_fin in claim["metadata"].get("finalizers", []):
                return False
        return True

    watch.until(f"{node_fin} removed from A's claims", finalizers_gone, timeout=30)
    for name in claims_a:
        _until_node_lost_event(
            watch, e2e, "ResourceClaim", name, lambda m: f"{OUT_OF_SERVICE}:NoExecute" in m
        )
    # The taint manager evicts A's pods (they stay Terminating: no kubelet confirms); the
    # ReplicaSet's replacements are placed on B, never on the out-of-service node.
    watch.until(
        "2 replacement pods running on B",
        lambda: len(_running_on(e2e, "work", b.name)) == 2,
        timeout=90,
    )
    evicted = {p.metadata.name for p in _pods(e2e, "work") if p.metadata.deletion_timestamp}
    assert evicted == set(on_a)
    _force_delete(e2e, on_a)  # PodGC does this once the node is also NotReady
    watch.mark("A's terminating pods force-deleted")
    _until_freed_and_deleted(watch, e2e, claims_a)
    assert len(a.hardware_view().instances) == 2

    # Back in service: taint removed, the node boots with its old GPU state.
    e2e.core.patch_node(a.name, {"spec": {"taints": []}})
    log_before = len(a.plugin_log.read_bytes())
    a.come_back()
    watch.mark("node A back in service, plugin registered")
    watch.until("A's stale instances destroyed", lambda: a.hardware_view().instances == ())
    watch.lost = ()
    log = a.plugin_log.read_bytes()[log_before:].decode()
    assert log.count("releasing claim that no longer exists in the API") == 2, log[-3000:]
    assert e2e.check_invariants() == []
    assert e2e.check_at_rest() == []
    watch.report()
