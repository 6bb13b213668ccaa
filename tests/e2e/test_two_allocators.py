"""Two allocators, one GPU (issue 30.4): whatever path a pod takes to kube-scheduler, no device
is ever held by two claims.

kube-scheduler allocates any claim whose pod is not gated; carve's controller allocates from its
own model. The shipped carve-sole-allocator policy (deploy/manifests/31-sole-allocator.yaml,
installed by the suite, naming the controller's user) lets only carve-controller allocate a
claim of carve's classes, so a pod that escaped the gate is placed by carve, ungated. The
invariant checker (nodesim/invariants.py) reads every claim and the simulated GPUs all along.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from devcluster.waiting import wait_for
from nodesim.stack import CarveStack
from tests.e2e.harness import E2E, environment_for, profile_is, request

pytestmark = pytest.mark.cluster

ROUNDS = 20
PER_PATH = 2  # gated and ungated pods per round, all racing for one H100's two 3g.40gb


@pytest.fixture
def ungated(carve: CarveStack, request: pytest.FixtureRequest) -> Iterator[E2E]:
    """A namespace outside the admission gate's selector: its pods are never gated."""
    yield from environment_for(carve, request, namespace_labels={})


class _Checker(threading.Thread):
    """Checks the invariants until stopped; keeps every violation it saw."""

    def __init__(self, e2e: E2E) -> None:
        super().__init__(name="invariant-checker", daemon=True)
        self.e2e = e2e
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.checks = 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.violations.extend(self.e2e.check_invariants())
            except Exception as exc:  # an API hiccup is not a violation
                print(f"checker: {exc}")
            self.checks += 1


def _allocated(envs: tuple[E2E, ...]) -> int:
    return sum(1 for env in envs for c in env.claims() if E2E.results(c))


def test_gated_and_ungated_pods_racing_for_one_gpu_never_share_a_device(
    e2e: E2E, ungated: E2E
) -> None:
    e2e.node("h100", "H100-SXM5-80GB")
    for env in (e2e, ungated):
        env.template("half", [request("mig", [profile_is("3g.40gb")])], gated=env is e2e)
    checker = _Checker(e2e)
    checker.start()
    envs = (e2e, ungated)
    try:
        for r in range(ROUNDS):
            for i in range(PER_PATH):
                for env in envs:  # interleaved, so both paths race from the first pod
                    manifest = e2e.pod_manifest(
                        f"r{r}-{i}", {"mig": {"resourceClaimTemplateName": "half"}}
                    )
                    env.core.create_namespaced_pod(env.namespace, manifest)
            wait_for(
                f"round {r}: the GPU's two 3g.40gb allocated",
                lambda: checker.violations or _allocated(envs) >= 2,
                timeout=30,
            )
            violations = checker.violations + e2e.check_invariants()
            assert not violations, "\n".join(violations)
            assert _allocated(envs) == 2
            for env in envs:
                env.core.delete_collection_namespaced_pod(env.namespace, grace_period_seconds=0)
            wait_for(
                f"round {r}: claims released and instances destroyed",
                lambda: not any(env.claims() for env in envs) and e2e.instance_count() == 0,
                timeout=30,
            )
    finally:
        checker.stop.set()
        checker.join(5)
    assert not checker.violations, "\n".join(checker.violations)
    assert checker.checks > ROUNDS


def test_a_pod_created_before_its_template_is_placed_by_carve(e2e: E2E) -> None:
    """The gate policy reads templates from the apiserver's cache: a pod that comes first
    (here, by construction; in a one-file `kubectl apply`, by a few milliseconds) is not gated.
    kube-scheduler may not allocate its claim; carve does, and the pod runs."""
    e2e.node("h100", "H100-SXM5-80GB")
    e2e.pod("p", {"mig": {"resourceClaimTemplateName": "late"}}, run_seconds=60)
    pod = e2e.raw_pod("p")
    assert pod is not None and not pod["spec"].get("schedulingGates")  # escaped the gate
    e2e.template("late", [request("mig", [profile_is("1g.")])], gated=False)
    e2e.wait_phase("p", "Running")
    claim = e2e.claim_of("p", "mig")
    assert e2e.stack.contract.allocation_finalizer in claim["metadata"]["finalizers"]
    wait_for(  # events are written beside the decision thread: the pod may run first
        "carve's PlacingUngated and Placed events on p",
        lambda: [ev["reason"] for ev in e2e.events("Pod", "p")],
        until=lambda reasons: "PlacingUngated" in reasons and "Placed" in reasons,
        timeout=30,
    )
    assert not e2e.check_invariants()
