"""The leader fence proven end to end (issue 41.4): a leader SIGKILLed with an allocation write
in flight, the write held in a proxy until the standby has taken the lease and decided, then
let go to the apiserver. The chart's `carve-leader-fence` must refuse it; without the fence it
lands and one device is held by two claims.

All parts are real: the apiserver with the chart installed (parked: the test runs the
controllers itself), two `carve-controller` processes electing a leader, each authenticated by
a carve-controller token bound to a stand-in pod named as its `--identity` (what the chart's
pods are: POD_NAME is the identity), and the chart's own controller settings (its ConfigMap).
The first leader reaches the apiserver only through `tests.support.apiproxy` in `as_client`
mode: TLS terminated there, every request forwarded with the leader's own token, watches
streamed, and its allocation PATCH held.

Why the late write would otherwise land: the fleet is one H100, and two claims ask for its one
7g.80gb placement. The leader places claim x there (held); pod p2 of higher priority arrives
for claim y; the leader dies. The standby sees x unallocated and serves p2 first, so y gets the
placement and nothing writes x: the dead leader's PATCH still carries x's current
resourceVersion, so optimistic concurrency does not stop it. Only the fence does.

`CARVE_FENCE_ROUNDS` (default 3) sets the rounds; `CARVE_FENCE_OFF=1` deletes the fence's
binding after the install, to see what the same test finds without it (it then fails). The
test prints `rounds=N held_writes_refused=R overlaps=O`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from devcluster.cluster import LocalCluster, api_client_for
from devcluster.pytest_plugin import (  # noqa: F401  (fixtures, used by name)
    fake_node,
    k8s_api,
    namespace,
    node_heartbeater,
)
from devcluster.waiting import wait_for
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.contract import Contract
from driver.resourceslice import build_resource_slices
from nodesim.invariants import NodeHardware, allocated_devices, overlaps
from tests.controller.cluster.objects import claims_of, gpu
from tests.support.apiproxy import ApiProxy, Hold
from tests.support.controller_cluster import ControllerProcess
from tests.support.helm import NOWHERE, Helm, parked_install
from tests.support.sa_tokens import service_account_token, token_kubeconfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CONTRACT = Contract("mig.fence.carve.dev")
RELEASE = NAMESPACE = "carve-fence"
BINDING = "carve-leader-fence-" + CONTRACT.driver.replace(".", "-")
LEADER, STANDBY = "carve-fence-a", "carve-fence-b"  # stand-in pod names = --identity
HIGH = "carve-fence-high"
H100 = "H100-SXM5-80GB"
ROUNDS = int(os.environ.get("CARVE_FENCE_ROUNDS", "3"))
UNFENCED = os.environ.get("CARVE_FENCE_OFF") == "1"
MERGE = "application/merge-patch+json"


@pytest.fixture(scope="module")
def install(k8s_cluster: LocalCluster, helm: Helm) -> Iterator[Path]:
    """The chart, parked, with its own driver name; its fence's binding deleted under
    CARVE_FENCE_OFF (what a cluster without the fence runs)."""
    kubeconfig = Path(k8s_cluster.info.kubeconfig)
    with parked_install(
        helm, kubeconfig, RELEASE, NAMESPACE, f"driverName={CONTRACT.driver}"
    ) as installed:
        if UNFENCED:
            api = client.AdmissionregistrationV1Api(api_client_for(installed))
            api.delete_validating_admission_policy_binding(BINDING)
        yield installed


def _whole_mig_claim(name: str) -> Obj:
    """A claim for the one 7g.80gb placement of an H100: two such claims cannot share it."""
    selector = f'device.attributes["{CONTRACT.driver}"].profile == "7g.80gb"'
    exactly = {"deviceClassName": CONTRACT.driver, "selectors": [{"cel": {"expression": selector}}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": exactly}]}},
    }


def _gated_pod(name: str, claim: str, priority_class: str | None = None) -> Obj:
    container = {"name": "main", "image": "registry.invalid/none"}
    spec: Obj = {
        "schedulingGates": [{"name": CONTRACT.scheduling_gate}],
        "resourceClaims": [{"name": "mig", "resourceClaimName": claim}],
        "containers": [{**container, "resources": {"claims": [{"name": "mig"}]}}],
        "terminationGracePeriodSeconds": 0,
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _stand_in(name: str) -> Obj:
    """A carve-controller pod that never runs (gated by a gate nobody removes, scheduled
    nowhere): what the chart's replica is to the apiserver, a pod its token is bound to."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": "carve-controller",
            "schedulingGates": [{"name": "carve.test/stand-in"}],
            "nodeSelector": NOWHERE,
            "containers": [{"name": "c", "image": "carve.local/none:0"}],
        },
    }


def _allocation_of(claim: str) -> Callable[[str, str, bytes], bool]:
    """A write of `claim`'s status that sets an allocation (a clear sets it to null)."""

    def match(method: str, path: str, body: bytes) -> bool:
        if method not in ("PATCH", "PUT"):
            return False
        if not path.partition("?")[0].endswith(f"/resourceclaims/{claim}/status"):
            return False
        with contextlib.suppress(ValueError):
            doc = json.loads(body)
            return isinstance(doc, dict) and bool((doc.get("status") or {}).get("allocation"))
        return False

    return match


def _holder(coordination: client.CoordinationV1Api) -> str | None:
    try:
        lease = coordination.read_namespaced_lease("carve-controller", NAMESPACE)
    except client.ApiException:
        return None
    assert lease.spec is not None
    return lease.spec.holder_identity


def _allocated(claims: list[Obj], name: str) -> bool:
    return any(
        c["metadata"]["name"] == name and (c.get("status") or {}).get("allocation") for c in claims
    )


@dataclass
class Round:
    answer: int  # what the apiserver answered the dead leader's held write
    refused_by_fence: bool
    overlaps: list[str]


@dataclass
class Fleet:
    """What every round uses: the clients, the proxy in front of the first leader, each
    replica's kubeconfig, the chart's controller settings."""

    api: client.ApiClient
    ns: str
    proxy: ApiProxy
    kubeconfigs: dict[str, Path]
    settings: dict[str, str]
    hardware: dict[str, NodeHardware]
    logs: Path

    def start(self, identity: str, round_no: int) -> ControllerProcess:
        return ControllerProcess(
            self.kubeconfigs[identity],
            NAMESPACE,
            self.logs / f"{identity}-{round_no}.log",
            identity,
            ["--preemption=false"],  # the standby must not evict p1 for p2: it waits instead
            env=self.settings,
        ).start()


def _round(fleet: Fleet, r: int) -> Round:
    """One kill: the leader's allocation of x held, the leader SIGKILLed, the standby leads
    and gives the placement to y; then the held write goes to the apiserver."""
    res, core = client.ResourceV1Api(fleet.api), client.CoreV1Api(fleet.api)
    coordination = client.CoordinationV1Api(fleet.api)
    ns, x, y = fleet.ns, f"x{r}", f"y{r}"
    body: Any
    for body in (_whole_mig_claim(x), _whole_mig_claim(y)):
        res.create_namespaced_resource_claim(ns, body)
    held: Hold = fleet.proxy.hold(_allocation_of(x))
    leader = fleet.start(LEADER, r)
    standby: ControllerProcess | None = None
    try:
        wait_for("the first leader", lambda: _holder(coordination) == LEADER, 60)
        standby = fleet.start(STANDBY, r)
        body = _gated_pod(f"p1-{r}", x)
        core.create_namespaced_pod(ns, body)
        wait_for("the leader's allocation of x to be held", lambda: held.requests, 60)
        body = _gated_pod(f"p2-{r}", y, HIGH)
        core.create_namespaced_pod(ns, body)
        leader.kill()
        wait_for("the standby to lead", lambda: _holder(coordination) == STANDBY, 60)
        claims = wait_for(
            "the standby to allocate y", lambda: claims_of(fleet.api, ns),
            timeout=60, until=lambda got: _allocated(got, y),
        )  # fmt: skip
        assert not _allocated(claims, x), "the standby gave x the placement: nothing to fence"
        held.release()
        (answer,) = wait_for("the apiserver's answer to the held write", lambda: held.answers, 60)
        held_devices = allocated_devices(claims_of(fleet.api, ns), CONTRACT.driver)
        return Round(
            answer=answer.status,
            refused_by_fence=answer.status == 403
            and b"does not hold the leader lease" in answer.body,
            overlaps=overlaps(held_devices, fleet.hardware),
        )
    finally:
        held.release()
        leader.kill()
        if standby is not None:
            standby.stop()
        _clear_round(fleet, r)


def _clear_round(fleet: Fleet, r: int) -> None:
    """Pods and claims of round `r` gone (finalizers dropped: no controller runs now), so the
    next round finds the placement free."""
    core, res = client.CoreV1Api(fleet.api), client.ResourceV1Api(fleet.api)
    for pod in (f"p1-{r}", f"p2-{r}"):
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod(pod, fleet.ns, grace_period_seconds=0)
    for claim in (f"x{r}", f"y{r}"):
        with contextlib.suppress(client.ApiException):
            res.patch_namespaced_resource_claim(
                claim, fleet.ns, {"metadata": {"finalizers": None}}, _content_type=MERGE
            )
            res.delete_namespaced_resource_claim(claim, fleet.ns)
    wait_for("round's claims gone", lambda: not claims_of(fleet.api, fleet.ns), 60)


@pytest.fixture
def fleet(
    install: Path,
    k8s_api: client.ApiClient,  # noqa: F811
    fake_node: Callable[..., str],  # noqa: F811
    namespace: str,  # noqa: F811
    tmp_path: Path,
) -> Iterator[Fleet]:
    """One fake node with one H100 of the chart's driver, a PriorityClass for p2, a stand-in
    pod and a pod-bound token per replica, and the proxy in front of the first leader."""
    core, res = client.CoreV1Api(k8s_api), client.ResourceV1Api(k8s_api)
    node = fake_node()
    slices: Any = build_resource_slices(
        driver=CONTRACT.driver, node_name=node, pool_generation=1, gpus=[gpu(H100, 0, node)]
    )
    for s in slices:
        res.create_resource_slice(s)
    with contextlib.suppress(client.ApiException):  # one per cluster; value beats p1's 0
        high: Any = {"metadata": {"name": HIGH}, "value": 1000}
        client.SchedulingV1Api(k8s_api).create_priority_class(high)
    pod: Any
    for pod in (_stand_in(LEADER), _stand_in(STANDBY)):
        core.create_namespaced_pod(NAMESPACE, pod)
    config_map = core.read_namespaced_config_map("carve-controller", NAMESPACE)
    settings = dict(config_map.data or {})
    token = {
        who: service_account_token(core, "carve-controller", NAMESPACE, who, seconds=3600)
        for who in (LEADER, STANDBY)
    }
    try:
        with ApiProxy(install, as_client=True) as proxy:
            yield Fleet(
                api=k8s_api,
                ns=namespace,
                proxy=proxy,
                kubeconfigs={
                    LEADER: proxy.kubeconfig(tmp_path / "leader.kubeconfig", token[LEADER]),
                    STANDBY: token_kubeconfig(
                        install, token[STANDBY], tmp_path / "standby.kubeconfig"
                    ),
                },
                settings=settings,
                hardware={node: NodeHardware(node, {0: gpu_model(H100)}, instances=())},
                logs=tmp_path,
            )
    finally:
        for name in (LEADER, STANDBY):
            core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
        with contextlib.suppress(client.ApiException):
            client.CoordinationV1Api(k8s_api).delete_namespaced_lease("carve-controller", NAMESPACE)
        res.delete_collection_resource_slice(field_selector=f"spec.nodeName={node}")


def _fence_bound(api: client.ApiClient) -> str:
    """Whether the fence's binding is there ("bound", "absent"): what the apiserver has, not
    what the test asked for, so a chart without the fence's template reads "absent" too."""
    try:
        client.AdmissionregistrationV1Api(api).read_validating_admission_policy_binding(BINDING)
    except client.ApiException as exc:
        if exc.status == 404:
            return "absent"
        raise
    return "bound"


def test_a_dead_leaders_held_write_never_gives_one_device_to_two_claims(fleet: Fleet) -> None:
    """ROUNDS kills, each with the dead leader's allocation released only after the standby
    decided: every one refused by the fence (403), and no device held by two claims."""
    started = time.monotonic()
    rounds = [_round(fleet, r) for r in range(ROUNDS)]
    refused = sum(r.refused_by_fence for r in rounds)
    found = [problem for r in rounds for problem in r.overlaps]
    print(
        f"\nrounds={len(rounds)} held_writes_refused={refused} overlaps={len(found)} "
        f"fence={_fence_bound(fleet.api)} answers={[r.answer for r in rounds]} "
        f"seconds={time.monotonic() - started:.0f}"
    )
    assert not found, "\n".join(found)
    assert refused == len(rounds), [r.answer for r in rounds]
