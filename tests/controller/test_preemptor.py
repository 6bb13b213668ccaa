"""Preemption through the reconciler, with the real placement engine behind it.

The writer is the in-memory store of tests/support/reconciler.py; the evictor below plays the
Eviction API (a refusal list stands for PodDisruptionBudgets) and marks evicted pods
terminating; the test then plays kube-controller-manager and the kubelet by deleting the
evicted pods.
"""

from __future__ import annotations

import copy
import datetime as dt

from controller.config import ReconcilerConfig
from controller.objects import EventType, Kind, Plan, Unplaceable
from controller.planner import EnginePlanner
from controller.preemption.eviction import EvictionOutcome, EvictionResult
from controller.preemption.preemptor import Preemptor
from controller.reconciler import Reconciler
from driver.apiobject import Obj
from tests.support.engine_cluster import Cluster, profile_claim
from tests.support.reconciler import pod

NOW = dt.datetime(2026, 1, 1, 1, 0, tzinfo=dt.UTC)
PDB_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."


class FakeEvictionApi:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.refuse: set[str] = set()
        self.dry_runs: list[str] = []
        self.evicted: list[str] = []
        self.budgets: list[Obj] = []
        self.error: Exception | None = None

    def evict(self, pod: Obj, *, dry_run: bool) -> EvictionResult:
        name = pod["metadata"]["name"]
        if self.error is not None:
            raise self.error
        (self.dry_runs if dry_run else self.evicted).append(name)
        if name in self.refuse:
            return EvictionResult(EvictionOutcome.BLOCKED, PDB_REFUSAL)
        if not dry_run:
            cur = self.cluster.writer.objects[name]
            cur["metadata"]["deletionTimestamp"] = "2026-01-01T01:00:00Z"
            self.cluster.rec.enqueue(Kind.POD, EventType.MODIFIED, self.cluster.writer.put(cur))
        return EvictionResult(EvictionOutcome.EVICTED)

    def disruption_budgets(self, namespace: str) -> list[Obj]:
        return self.budgets


class PreemptingCluster(Cluster):
    def __init__(self, nodes: dict[str, list[str]], config: ReconcilerConfig | None = None) -> None:
        super().__init__(nodes)
        self.api = FakeEvictionApi(self)
        self.clock = [0.0]
        self.planner = EnginePlanner("mig.carve.dev", clock=lambda: self.clock[0])
        self.rec = Reconciler(
            self.planner,
            self.writer,
            self.recorder,
            wall_clock=lambda: NOW,
            config=config,
            preemption=Preemptor(self.planner, self.api, self.recorder, wall_clock=lambda: NOW),
        )
        for k in Kind:
            self.rec.mark_synced(k)
        # Replay what the base class fed its own reconciler.
        from tests.support.engine_cluster import device_class, node, slices

        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("mig.carve.dev", "mig"))
        self.rec.enqueue(Kind.CLASS, EventType.ADDED, device_class("gpu.carve.dev", "gpu"))
        for n, models in nodes.items():
            self.rec.enqueue(Kind.NODE, EventType.ADDED, node(n))
            for s in slices(n, models):
                self.rec.enqueue(Kind.SLICE, EventType.ADDED, s)

    def run(self, name: str, started: str = "2026-01-01T00:30:00Z") -> None:
        """Play the scheduler and kubelet: the pod is bound to its claim's node and runs."""
        p = self.writer.objects[name]
        claim = self.writer.objects[p["spec"]["resourceClaims"][0]["resourceClaimName"]]
        sel = claim["status"]["allocation"]["nodeSelector"]
        p["spec"]["nodeName"] = sel["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
        p["status"] = {"phase": "Running", "startTime": started}
        self.rec.enqueue(Kind.POD, EventType.MODIFIED, self.writer.put(p))

    def gone(self, name: str) -> None:
        """An evicted pod has terminated and been deleted."""
        p = self.writer.objects.pop(name)
        self.rec.enqueue(Kind.POD, EventType.DELETED, p)

    def gpu_of(self, claim_name: str) -> tuple[str, int, int]:
        alloc = self.allocation(claim_name)
        assert alloc is not None
        (r,) = alloc["devices"]["results"]
        hit = self.planner.model.device(r["pool"], r["device"])
        assert hit is not None
        return hit[0].uuid, hit[1].profile_id, hit[1].start


def _fill(c: PreemptingCluster, plan: list[tuple[str, str, int]]) -> dict[str, str]:
    """Submit (claim, profile, priority) one at a time, each placed and running; claim -> pod."""
    pods = {}
    for claim, profile, prio in plan:
        pods[claim] = c.submit(profile_claim(claim, profile), prio=prio)
        c.rec.step()
        assert c.allocation(claim) is not None, c.recorder.events
        c.run(pods[claim])
    c.rec.step()
    return pods


def _two_full_a100s(c: PreemptingCluster) -> dict[str, str]:
    # GPU A: one 4g.20gb (priority 1) and three 1g.5gb; GPU B: seven 1g.5gb at priority 0.
    plan = [("big", "4g.20gb", 1)] + [(f"a{i}", "1g.5gb", 1) for i in range(3)]
    plan += [(f"b{i}", "1g.5gb", 0) for i in range(7)]
    return _fill(c, plan)


def test_the_single_cheapest_victim_is_evicted_and_its_slices_go_to_the_preemptor() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB", "A100-SXM4-40GB"]})
    pods = _two_full_a100s(c)
    big_gpu = c.gpu_of("big")
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    # One victim of priority 1 beats four of priority 0: fewest first.
    assert c.api.evicted == [pods["big"]]
    assert c.allocation("hi") is None
    (preempted,) = [e for e in c.recorder.events if e[2] == "Preempted"]
    assert preempted[0] == pods["big"] and hi in preempted[3] and "4g.20gb" in preempted[3]
    waits = c.events_of(hi)
    assert waits[-1][2] == "Preempting" and pods["big"] in waits[-1][3]
    assert c.writer.conditions[hi][:2] == (False, "Preempting")
    c.gone(pods["big"])
    c.rec.step()
    assert c.gpu_of("hi") == big_gpu
    assert c.writer.conditions[hi][:2] == (True, "Placed")
    assert c.api.evicted == [pods["big"]]


def test_equal_priority_pods_are_never_evicted_and_never_policy_is_honoured() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    _fill(c, [(f"a{i}", "1g.5gb", 5) for i in range(7)])
    same = c.submit(profile_claim("same", "4g.20gb"), prio=5)
    c.rec.step()
    assert c.api.evicted == [] and c.api.dry_runs == []
    assert c.allocation("same") is None
    c2 = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    _fill(c2, [(f"a{i}", "1g.5gb", 0) for i in range(7)])
    name = c2.submit(profile_claim("polite", "4g.20gb"), prio=9)
    p = c2.writer.objects[name]
    p["spec"]["preemptionPolicy"] = "Never"
    c2.rec.enqueue(Kind.POD, EventType.MODIFIED, c2.writer.put(p))
    c2.rec.step()
    assert c2.api.evicted == []
    assert "preemptionPolicy is Never" in c2.events_of(name)[-1][3]
    del same


def test_a_pdb_refusal_makes_the_search_choose_another_set() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB", "A100-SXM4-40GB"]})
    pods = _two_full_a100s(c)
    c.api.refuse.add(pods["big"])
    c.rec.step()
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    # The refused pod was only ever dry-run; four 1g.5gb pods at slices 0-3 of GPU B go.
    assert pods["big"] in c.api.dry_runs and pods["big"] not in c.api.evicted
    evicted = set(c.api.evicted)
    assert len(evicted) == 4 and evicted <= {pods[f"b{i}"] for i in range(7)}
    starts = sorted(c.gpu_of(k)[2] for k, v in pods.items() if v in evicted)
    assert starts == [0, 1, 2, 3]
    # While the victims terminate one by one, what they free is held: a small pod that
    # arrives meanwhile does not get the first freed slice.
    first, *rest = sorted(evicted)
    c.gone(first)
    c.rec.step()
    small = c.submit(profile_claim("small", "1g.5gb"), prio=0)
    c.rec.step()
    assert c.allocation("small") is None
    assert c.allocation("hi") is None
    assert "held for this pod" in c.events_of(hi)[-1][3]
    for name in rest:
        c.gone(name)
    c.rec.step()
    assert c.gpu_of("hi")[2] == 0
    assert c.allocation("small") is None
    del small


def test_with_every_set_refused_the_pod_waits_with_a_reason() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    pods = _fill(c, [(f"a{i}", "1g.5gb", 0) for i in range(7)])
    c.api.refuse.update(pods.values())
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    assert c.api.evicted == []
    (last,) = [e for e in c.events_of(hi) if e[2] == "PreemptionBlocked"]
    assert "disruption budget" in last[3]


def test_the_hold_ends_when_the_preemptor_goes_away() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    pods = _fill(c, [("big", "4g.20gb", 0), ("x", "3g.20gb", 3)])
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    assert c.api.evicted == [pods["big"]]
    c.gone(pods["big"])
    c.gone(hi)
    c.submit(profile_claim("late", "4g.20gb"), prio=1)
    c.rec.step()
    assert c.allocation("late") is not None


def test_freed_slices_stay_held_until_the_hold_expires() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    pods = _fill(c, [("big", "4g.20gb", 0)])
    c.planner.reserve("ns/hi", "n1", [f"ns/{pods['big']}"], ["ns/big"], hold_s=10.0)
    cleared = copy.deepcopy(c.writer.objects["big"])
    del cleared["status"]["allocation"]
    c.planner.observe(Kind.CLAIM, cleared)
    classes = c.rec.stores[Kind.CLASS]
    other = pod("other", ["o"])
    want = profile_claim("o", "4g.20gb")
    assert isinstance(c.planner.plan(other, [want], classes), Unplaceable)
    c.clock[0] = 10.0
    assert isinstance(c.planner.plan(other, [want], classes), Plan)


def test_an_eviction_api_error_is_told_on_the_pod_not_mistaken_for_a_write_failure() -> None:
    from kubernetes.client.exceptions import ApiException

    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]})
    _fill(c, [("big", "4g.20gb", 0)])
    c.api.error = ApiException(status=403, reason="Forbidden")
    c.api.error.body = (
        '{"message": "pods \\"x\\" is forbidden: cannot create resource \\"pods/eviction\\""}'
    )
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    (ev,) = [e for e in c.events_of(hi) if e[2] == "PreemptionBlocked"]
    assert "403" in ev[3] and "pods/eviction" in ev[3]


def test_a_budget_the_disruption_controller_observed_limits_the_set_before_any_dry_run() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB", "A100-SXM4-40GB"]})
    pods = _two_full_a100s(c)
    big = c.writer.objects[pods["big"]]
    big["metadata"]["labels"] = {"app": "big"}
    c.rec.enqueue(Kind.POD, EventType.MODIFIED, c.writer.put(big))
    c.api.budgets = [
        {
            "metadata": {"name": "big", "namespace": "ns", "generation": 1},
            "spec": {"selector": {"matchLabels": {"app": "big"}}},
            "status": {"observedGeneration": 1, "disruptionsAllowed": 0},
        }
    ]
    c.submit(profile_claim("hi", "4g.20gb"), prio=10)
    c.rec.step()
    assert pods["big"] not in c.api.dry_runs
    assert len(c.api.evicted) == 4


def test_a_pod_due_for_native_fallback_evicts_nobody() -> None:
    c = PreemptingCluster({"n1": ["A100-SXM4-40GB"]}, ReconcilerConfig(native_fallback_after=60))
    _fill(c, [("big", "4g.20gb", 0)])
    hi = c.submit(profile_claim("hi", "4g.20gb"), prio=10)  # created an hour before NOW
    c.rec.step()
    assert c.api.evicted == [] and c.api.dry_runs == []
    assert any(e[2] == "HandedToScheduler" for e in c.events_of(hi))
