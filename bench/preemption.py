"""Victim counts of carve's preemption search against a naive policy, on seeded scenarios.

Run: python -m bench.preemption [--seeds 40] [--nodes 4] [--gpus 2]

Each scenario is a cluster of A100-40GB and H100-80GB GPUs that the placement engine itself
fills with random small MIG profiles (1g, 2g, 3g) at random priorities (0-4) and running
times; then a pod of priority 10 asks for a contiguous 4g slice (4g.20gb or 4g.40gb), which
fits nowhere. Three policies pick victims, all judged by the same oracle (the engine on the
model with the victims' claims released), so every set they report really frees a placement:

* carve: ``controller.preemption.search.cheapest_victims`` (fewest, lowest priority, least
  work lost);
* naive per node: on each node evict the lowest-priority pods first (shortest-running among
  equals) until the pod fits, and keep the node that needed fewest;
* naive cluster-wide: evict the cluster's lowest-priority pods first until the pod fits
  somewhere (what a policy blind to MIG geometry and to nodes does).

Figures are printed, not asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import time
from collections.abc import Sequence

from controller.objects import Kind, Plan
from controller.placement import NoPlacement, PlacementRequest
from controller.planner import EnginePlanner
from controller.preemption.search import Candidate, SearchLimits, cheapest_victims
from controller.status import build_allocation_status
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices

DRIVER = "mig.carve.dev"
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
PROFILES = {
    "A100-SXM4-40GB": ["1g.5gb", "1g.5gb", "1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb"],
    "H100-SXM5-80GB": ["1g.10gb", "1g.10gb", "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb"],
}
"""The fill: mostly small slices, no 4g (one 4g victim would make every answer trivial);
``--fill tiny`` keeps only 1g and 2g, so a 4g slice always needs several victims."""
TINY = {m: [p for p in ps if p[0] in "12"] for m, ps in PROFILES.items()}
WANT = f'device.attributes["{DRIVER}"].profile in ["4g.20gb", "4g.40gb"]'


def _class() -> Obj:
    expr = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "mig"'
    return {
        "metadata": {"name": DRIVER, "uid": DRIVER, "resourceVersion": "1"},
        "spec": {"selectors": [{"cel": {"expression": expr}}]},
    }


def _claim(name: str, selector: str) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
        "status": {},
    }


def _pod(name: str, claim: str, priority: int) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "priority": priority,
            "resourceClaims": [{"name": "mig", "resourceClaimName": claim}],
        },
        "status": {"phase": "Pending"},
    }


def _node(name: str) -> Obj:
    return {
        "metadata": {"name": name, "uid": f"node-{name}", "resourceVersion": "1"},
        "spec": {},
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _node_slices(node: str, models: Sequence[str]) -> list[Obj]:
    gpus = [
        PublishedGpu(
            minor=i,
            uuid=f"GPU-{node}-{i}",
            model=gpu_model(m),
            pci_bus_id=f"0000:{i + 7:02x}:00.0",
            driver_version="580.105.08",
        )
        for i, m in enumerate(models)
    ]
    out = build_resource_slices(driver=DRIVER, node_name=node, pool_generation=1, gpus=gpus)
    for s in out:
        s["metadata"].update(uid=s["metadata"]["name"], resourceVersion="1")
    return out


class Scenario:
    """A filled cluster, its candidates, and the preemptor's request."""

    def __init__(
        self, seed: int, nodes: int, gpus: int, profiles: dict[str, list[str]] = PROFILES
    ) -> None:
        rng = random.Random(seed)
        self.planner = EnginePlanner(DRIVER)
        classes = {DRIVER: _class()}
        self.planner.observe(Kind.CLASS, classes[DRIVER])
        models: dict[str, list[str]] = {}
        for n in range(nodes):
            models[f"n{n}"] = [rng.choice(list(PROFILES)) for _ in range(gpus)]
            self.planner.observe(Kind.NODE, _node(f"n{n}"))
            for s in _node_slices(f"n{n}", models[f"n{n}"]):
                self.planner.observe(Kind.SLICE, s)
        self.candidates: list[Candidate] = []
        self.claim_of: dict[str, str] = {}
        every = [p for ms in models.values() for m in ms for p in profiles[m]]
        for i in range(nodes * gpus * 9):
            claim = _claim(
                f"c{i}", f'device.attributes["{DRIVER}"].profile == "{rng.choice(every)}"'
            )
            pod = _pod(f"v{i}", f"c{i}", 0)
            verdict = self.planner.plan(pod, [claim], classes)
            if not isinstance(verdict, Plan):
                continue
            claim["status"]["allocation"] = build_allocation_status(
                claim, verdict.allocations[0], classes, NOW
            )
            self.planner.observe(Kind.CLAIM, claim)
            self.candidates.append(
                Candidate(f"ns/v{i}", verdict.node, rng.randint(0, 4), rng.uniform(0, 3600))
            )
            self.claim_of[f"ns/v{i}"] = f"ns/c{i}"
        request = self.planner.placement_request(_pod("hi", "want", 10), [_claim("want", WANT)])
        assert isinstance(request, PlacementRequest)
        self.request = request
        self.checks = 0

    def fits_now(self) -> bool:
        return not isinstance(self.planner.engine.place(self.request), NoPlacement)

    def feasible(self, node: str, victims: frozenset[str]) -> bool:
        self.checks += 1
        freed = [self.claim_of[v] for v in victims]
        return self.planner.placement_without(self.request, node, freed, victims) is not None


def _naive_per_node(sc: Scenario, prio: int) -> list[Candidate] | None:
    best: list[Candidate] | None = None
    for node in sorted({c.node for c in sc.candidates}):
        order = sorted(
            (c for c in sc.candidates if c.node == node and c.priority < prio),
            key=lambda c: (c.priority, c.running_s),
        )
        taken: list[Candidate] = []
        for c in order:
            taken.append(c)
            if sc.feasible(node, frozenset(t.pod for t in taken)):
                if best is None or len(taken) < len(best):
                    best = list(taken)
                break
    return best


def _naive_global(sc: Scenario, prio: int) -> list[Candidate] | None:
    order = sorted(
        (c for c in sc.candidates if c.priority < prio), key=lambda c: (c.priority, c.running_s)
    )
    taken: list[Candidate] = []
    nodes = sorted({c.node for c in sc.candidates})
    for c in order:
        taken.append(c)
        for node in nodes:
            if sc.feasible(node, frozenset(t.pod for t in taken if t.node == node)):
                return list(taken)
    return None


def _summary(name: str, sets: list[list[Candidate] | None], extra: str = "") -> None:
    found = [s for s in sets if s is not None]
    counts = [len(s) for s in found]
    prios = [sum(c.priority for c in s) for s in found]
    lost = [sum(c.running_s for c in s) / 3600 for s in found]
    print(
        f"{name:<20} found {len(found):>3}/{len(sets)}  victims total {sum(counts):>4}  "
        f"mean {statistics.mean(counts) if counts else 0:5.2f}  max {max(counts, default=0):>2}  "
        f"priority sum {sum(prios):>4}  GPU-hours lost {sum(lost):7.1f}{extra}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--fill", choices=("small", "tiny"), default="small")
    args = parser.parse_args(argv)
    carve: list[list[Candidate] | None] = []
    per_node: list[list[Candidate] | None] = []
    cluster: list[list[Candidate] | None] = []
    checks: list[int] = []
    seconds: list[float] = []
    skipped = 0
    for seed in range(args.seeds):
        sc = Scenario(seed, args.nodes, args.gpus, TINY if args.fill == "tiny" else PROFILES)
        if sc.fits_now():
            skipped += 1
            continue
        sc.checks = 0
        started = time.perf_counter()
        result = cheapest_victims(10, sc.candidates, sc.feasible, limits=SearchLimits())
        seconds.append(time.perf_counter() - started)
        checks.append(sc.checks)
        carve.append(list(result.chosen.victims) if result.chosen else None)
        per_node.append(_naive_per_node(sc, 10))
        cluster.append(_naive_global(sc, 10))
    print(
        f"{len(carve)} scenarios ({skipped} skipped: the pod fit without preemption), "
        f"{args.nodes} nodes x {args.gpus} GPUs (A100-40GB / H100-80GB), {args.fill} fill, "
        "pod priority 10 asking a 4g slice"
    )
    _summary(
        "carve",
        carve,
        f"  search {statistics.median(seconds) * 1e3:.1f} ms median, "
        f"{max(seconds) * 1e3:.1f} ms max, {statistics.median(checks):.0f} engine checks median",
    )
    _summary("naive per node", per_node)
    _summary("naive cluster-wide", cluster)
    fewer = sum(1 for a, b in zip(carve, per_node, strict=True) if a and b and len(a) < len(b))
    worse = sum(1 for a, b in zip(carve, per_node, strict=True) if a and b and len(a) > len(b))
    print(f"carve evicts fewer pods than naive per node in {fewer} scenarios, more in {worse}")


if __name__ == "__main__":
    main()
