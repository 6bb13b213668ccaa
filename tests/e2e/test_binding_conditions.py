"""Carve before bind on the real control plane (issue 11, point 3): nodes whose plugin runs
with --binding-conditions publish devices with `<driver>/Carved` / `<driver>/CarveFailed`, carve's
controller copies them into the allocation, the plugin carves as soon as the allocation
appears, and kube-scheduler v1.37 binds the pod only after the claim's status.devices says
Carved. A carve that NVML refuses sets CarveFailed, the GPU is tainted carve-failed for a
while, and the claim is placed again on another GPU; the pod is bound once, after the
successful carve there.

Both controller modes run: `gate-held` (the default, `--hold-gate-until-carved`: the pod stays
gated until the node reports, so kube-scheduler binds at its first check, and the controller
itself re-plans a failed carve) and `scheduler-waits` (`--hold-gate-until-carved=false`:
kube-scheduler waits in PreBind, gives a failed allocation up in PostFilter, and the
controller re-plans the cleared claim). The second runs as its own install under another
driver name, next to the package's.

A watcher thread samples pod and claim every 20 ms, so "bound only after Carved" is checked
on what the API showed, not on what the components logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller.informers import Informer
from controller.objects import Kind
from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.contract import DEFAULT_CONTRACT, Contract
from driver.nvml import sim
from nodesim.stack import CarveStack
from process.kube.jsonclient import KubeJson
from process.kube.listwatch import JsonCollection
from tests.e2e.harness import E2E, cel, environment_for, request

pytestmark = pytest.mark.cluster

BINDING = ("--binding-conditions",)
WAITS = Contract("mig.bindwait.carve.dev")
WAITS_LABELS = {"e2e.carve.dev/bindwait": "on"}


@dataclass
class Mode:
    name: str
    e2e: E2E
    contract: Contract

    def template(self) -> None:
        attrs = f'device.attributes["{self.contract.driver}"]'
        profile = cel(f'{attrs}.profile.startsWith("1g.10gb")')
        self.e2e.template(
            "one-1g", [request("mig", [profile], device_class=self.contract.mig_class)]
        )


@pytest.fixture(scope="module")
def waits_stack(
    k8s_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CarveStack]:
    stack = CarveStack(
        Path(k8s_cluster.info.kubeconfig), tmp_path_factory.mktemp("bindwait"), contract=WAITS
    )
    try:
        stack.install(gate_namespaces=WAITS_LABELS)
        stack.start_controller("--hold-gate-until-carved=false")
        yield stack
    finally:
        stack.stop()


@pytest.fixture(params=["gate-held", "scheduler-waits"])
def mode(request: pytest.FixtureRequest) -> Iterator[Mode]:
    if request.param == "gate-held":
        carve: CarveStack = request.getfixturevalue("carve")
        for env in environment_for(carve, request):
            yield Mode(request.param, env, DEFAULT_CONTRACT)
    else:
        stack: CarveStack = request.getfixturevalue("waits_stack")
        for env in environment_for(stack, request, WAITS_LABELS):
            yield Mode(request.param, env, WAITS)


@dataclass
class _Seen:
    """What the watches delivered (every version, not samples): the True conditions each
    allocated device ever had, the etcd revision at which each device was first Carved, and
    the revision at which the pod first showed a node."""

    contract: Contract
    verdicts: dict[str, set[str]] = field(default_factory=dict)
    carved_rv: dict[str, int] = field(default_factory=dict)
    bound_rv: int | None = None
    delivered_rv: dict[Kind, int] = field(default_factory=dict)  # the latest per watch
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _delivered(self, kind: Kind, rv: int) -> None:
        self.delivered_rv[kind] = max(rv, self.delivered_rv.get(kind, rv))

    def delivered(self) -> dict[Kind, int]:
        with self.lock:
            return dict(self.delivered_rv)

    def on_claim(self, _kind: Any, _type: Any, claim: Obj) -> None:
        rv = int(claim["metadata"]["resourceVersion"])
        alloc = (claim.get("status") or {}).get("allocation") or {}
        with self.lock:
            self._delivered(Kind.CLAIM, rv)
            for r in (alloc.get("devices") or {}).get("results") or []:
                conds = _true_conditions(claim, r["device"], self.contract)
                self.verdicts.setdefault(r["device"], set()).update(conds)
                if self.contract.carved_condition in conds:
                    self.carved_rv[r["device"]] = min(rv, self.carved_rv.get(r["device"], rv))

    def on_pod(self, _kind: Any, _type: Any, pod: Obj) -> None:
        with self.lock:
            self._delivered(Kind.POD, int(pod["metadata"]["resourceVersion"]))
        if pod["metadata"]["name"] == "a" and (pod.get("spec") or {}).get("nodeName"):
            with self.lock:
                if self.bound_rv is None:
                    self.bound_rv = int(pod["metadata"]["resourceVersion"])


def _true_conditions(claim: Obj, device: str, contract: Contract) -> set[str]:
    for entry in (claim.get("status") or {}).get("devices") or []:
        if entry.get("driver") == contract.driver and entry.get("device") == device:
            return {c["type"] for c in entry.get("conditions") or [] if c["status"] == "True"}
    return set()


def _run_pod(mode: Mode, timeout: float) -> _Seen:
    e2e = mode.e2e
    seen = _Seen(mode.contract)
    ns = e2e.namespace
    informers = [
        Informer(
            Kind.CLAIM,
            JsonCollection(
                KubeJson(e2e.core.api_client),
                f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
            ),
            seen.on_claim,
            lambda _k: None,
        ),
        Informer(
            Kind.POD,
            JsonCollection(KubeJson(e2e.core.api_client), f"/api/v1/namespaces/{ns}/pods"),
            seen.on_pod,
            lambda _k: None,
        ),
    ]
    for inf in informers:
        threading.Thread(target=inf.run, args=(time.monotonic,), daemon=True).start()
    try:
        wait_for("the test's watches", lambda: all(i.has_synced for i in informers))
        e2e.pod("a", {"mig": {"resourceClaimTemplateName": "one-1g"}})
        running = e2e.wait_phase("a", "Running", timeout=timeout)
        # The watches deliver on their own threads: wait until they reached the running pod
        # and its claim as read now, so that everything which led there was delivered.
        claim_rv = int(e2e.claim_of("a", "mig")["metadata"]["resourceVersion"])
        pod_rv = int(running["metadata"]["resourceVersion"])
        wait_for(
            f"the test's watches to deliver claim rv {claim_rv} and pod rv {pod_rv}",
            seen.delivered,
            until=lambda rv: rv.get(Kind.CLAIM, 0) >= claim_rv and rv.get(Kind.POD, 0) >= pod_rv,
            timeout=30,
        )
    finally:
        for inf in informers:
            inf.stop()
    return seen


def _gpu_of(device: str) -> int:
    return int(device.split("-")[1])


def test_a_pod_is_bound_only_after_its_slice_is_carved(mode: Mode) -> None:
    e2e, c = mode.e2e, mode.contract
    e2e.node("bc", "H100-SXM5-80GB", plugin_args=BINDING)
    mode.template()
    seen = _run_pod(mode, timeout=90)
    claim = e2e.claim_of("a", "mig")
    (result,) = e2e.results(claim)
    assert result["bindingConditions"] == [c.carved_condition]
    assert result["bindingFailureConditions"] == [c.carve_failed_condition]
    # The claim said Carved (etcd revision) before the pod got its node.
    assert seen.bound_rv is not None, e2e.diagnostics("a")
    assert result["device"] in seen.carved_rv, (seen, e2e.diagnostics("a"))
    assert seen.carved_rv[result["device"]] < seen.bound_rv
    assert seen.verdicts == {result["device"]: {c.carved_condition}}
    assert e2e.check_invariants() == []


def test_a_failed_carve_is_placed_again_on_another_gpu_before_the_pod_binds(mode: Mode) -> None:
    e2e, c = mode.e2e, mode.contract
    node = e2e.node("bcf", "H100-SXM5-80GB", "H100-SXM5-80GB", plugin_args=BINDING)
    mode.template()
    sim.configure(node.sim_config)
    try:
        # The next GPU instance creation on this node fails as a sick GPU's would.
        sim.sim_inject_fault("CreateGpuInstanceWithPlacement", error="UNKNOWN")
    finally:
        sim.configure(None)
    seen = _run_pod(mode, timeout=120)

    failed = [d for d, conds in seen.verdicts.items() if c.carve_failed_condition in conds]
    assert len(failed) == 1, (seen.verdicts, e2e.diagnostics("a"))
    (result,) = e2e.results(e2e.claim_of("a", "mig"))
    assert _gpu_of(result["device"]) != _gpu_of(failed[0]), (failed, result)
    # Bound after the carve on the other GPU (the pod's node is final, so bound once).
    assert seen.bound_rv is not None
    assert seen.carved_rv[result["device"]] < seen.bound_rv
    assert failed[0] not in seen.carved_rv
    # The failed GPU is tainted for the cool-down, so neither allocator goes back to it.
    published = e2e.published_device(node.name, failed[0])
    assert {t["key"]: t["effect"] for t in published.get("taints") or []} == {
        c.carve_failed_taint_key: "NoSchedule"
    }

    # The user reads why on the pod: the controller (gate held) or kube-scheduler (which
    # names the failed condition) says so, with NVML's error.
    def told() -> list[Obj]:
        events = e2e.events("Pod", "a")
        if mode.name == "gate-held":
            return [e for e in events if e["reason"] == "CarveFailed"]
        return [e for e in events if "CarveFailed" in (e.get("message") or "")]

    (event, *_) = wait_for("an event on the pod about the failed carve", told, timeout=30)
    if mode.name == "gate-held":
        assert "NVML error 999" in event["message"], event
    assert e2e.check_invariants() == []
