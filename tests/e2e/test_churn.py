"""100 pods with random slice sizes and run times churn through a mixed cluster while the
controller and a node's plugin are killed (SIGKILL) and restarted. A checker reads every
node's simulated GPUs and every claim all along: no two allocations ever overlap, and no MIG
instance ever exists that no allocated claim names."""

from __future__ import annotations

import random
import threading
import time

import pytest

from devcluster.waiting import wait_for
from tests.e2e.harness import E2E, profile_is, request

pytestmark = pytest.mark.cluster

TOTAL = 100
IN_FLIGHT = 24
SIZES = (("1g.", 0.45), ("2g.", 0.25), ("3g.", 0.18), ("4g.", 0.12))


class _Checker(threading.Thread):
    def __init__(self, e2e: E2E) -> None:
        super().__init__(name="invariant-checker", daemon=True)
        self.e2e = e2e
        self.stop = threading.Event()
        self.violations: list[str] = []
        self.checks = 0
        self.max_instances = 0

    def run(self) -> None:
        while not self.stop.wait(0.3):
            try:
                found = self.e2e.check_invariants()
                self.max_instances = max(self.max_instances, self.e2e.instance_count())
            except Exception as exc:  # an API hiccup is not a violation; note and go on
                found = []
                print(f"checker: {exc}")
            self.checks += 1
            self.violations.extend(found)


def test_churn_100_pods_with_controller_and_plugin_killed(e2e: E2E) -> None:
    rng = random.Random(6)
    nodes = [
        e2e.node("a100", "A100-SXM4-40GB", "A100-SXM4-40GB"),
        e2e.node("h100", "H100-SXM5-80GB"),
        e2e.node("a30", "A30-24GB", "A30-24GB"),
    ]
    for prefix, _ in SIZES:
        e2e.template(f"s{prefix[0]}g", [request("mig", [profile_is(prefix)])])
    checker = _Checker(e2e)
    checker.start()
    stack = e2e.stack
    created: list[str] = []
    finished: dict[str, str] = {}
    killed_controller = killed_plugin = False
    begin = time.monotonic()

    def poll() -> None:
        for pod in e2e.core.list_namespaced_pod(e2e.namespace).items:
            if pod.status.phase in ("Succeeded", "Failed") and pod.metadata.name not in finished:
                finished[pod.metadata.name] = pod.status.phase
                if pod.status.phase == "Succeeded" and rng.random() < 0.5:
                    e2e.delete_pod(pod.metadata.name)  # half go through graceful deletion

    try:
        while len(finished) < TOTAL:
            assert time.monotonic() - begin < 300, (
                f"churn too slow: {len(finished)}/{TOTAL} done\n{e2e.diagnostics()}"
            )
            while len(created) < TOTAL and len(created) - len(finished) < IN_FLIGHT:
                prefix = rng.choices([p for p, _ in SIZES], [w for _, w in SIZES])[0]
                name = f"c{len(created):03d}"
                e2e.pod(
                    name,
                    {"mig": {"resourceClaimTemplateName": f"s{prefix[0]}g"}},
                    run_seconds=round(rng.uniform(0.5, 3.0), 1),
                )
                created.append(name)
            if len(created) >= 35 and not killed_controller:
                stack.kill_controller()
                time.sleep(1.5)
                stack.start_controller()
                killed_controller = True
            if len(created) >= 60 and not killed_plugin:
                nodes[0].kill_plugin()
                time.sleep(1.0)
                nodes[0].start_plugin()
                nodes[0].wait_plugin_ready()
                killed_plugin = True
            poll()
            time.sleep(0.3)
    finally:
        checker.stop.set()
        checker.join(timeout=10)

    elapsed = time.monotonic() - begin
    failed = {n: p for n, p in finished.items() if p != "Succeeded"}
    print(
        f"churn: {TOTAL} pods in {elapsed:.1f}s, {checker.checks} invariant checks, "
        f"peak {checker.max_instances} live instances"
    )
    assert failed == {}
    assert checker.violations == [], "\n".join(checker.violations[:20])
    assert checker.checks > 20 and checker.max_instances >= 5
    # Everything ended: once the claims are gone there is no instance anywhere.
    e2e.core.delete_collection_namespaced_pod(e2e.namespace)
    wait_for("claims to be released", lambda: not e2e.claims(), timeout=60)
    wait_for("no instance left", lambda: e2e.instance_count() == 0, timeout=30)
    assert e2e.check_at_rest() == []


def test_the_checker_sees_an_instance_no_claim_owns(e2e: E2E) -> None:
    """The churn's checker must be able to fail: carve behind carve's back and it reports."""
    from driver.nvml import sim
    from driver.nvml.backend import NvmlBackend

    node = e2e.node("a30", "A30-24GB")
    sim.configure(node.sim_config)
    try:
        backend = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()
        [gpu] = backend.gpus()
        profile = next(p for p in gpu.profiles if p.name == "2g.12gb")
        carved = backend.carve(gpu.uuid, profile.id, 2)
        try:
            [leak] = e2e.check_invariants()
            assert node.name in leak and "placement start 2" in leak
            assert e2e.check_at_rest()
        finally:
            backend.destroy(gpu.uuid, carved.gi_id)
            backend.close()
    finally:
        sim.configure(None)
    assert e2e.check_invariants() == []
