"""Upper bounds on what any placement policy can place in a saturation replay.

- :func:`fluid_bound` (in tests.bench.replay): every memory slice of every GPU usable by any
  request, no geometry, no nodes;
- :func:`configuration_bound`: the configuration linear program. For every catalogue model the
  GPU configurations that MIG geometry allows with the profiles the jobs ask for (enumerated
  with ``driver.geometry`` from the empty GPU; a whole GPU is its own configuration), then

      maximise   sum_t weight_t * sum_m z[t, m]
      subject to sum_c x[m, c] <= GPUs of model m
                 sum_{t asks p on m} count_t * z[t, m] <= sum_c c[p] * x[m, c]   per (m, p)
                 sum_m z[t, m] <= jobs of type t
                 sum_t cpu_t * z[t, m] <= cpu of the nodes of model m (memory alike;
                                          cpu_t the least a job of type t asks)
                 x, z >= 0

  where ``z[t, m]`` is how many jobs of type t land on model m and ``x[m, c]`` how many GPUs
  of model m are in configuration c. It ignores arrival order, which node a GPU sits on (a
  job asking for several GPUs counts as that many whole GPUs) and integrality, so it is an
  upper bound; it is tighter than the fluid bound because it knows that, say, an 8-slice GPU
  holds one 4g and that seven 1g leave its eighth memory slice unused.

The LP is small (tens of rows and columns); :func:`maximise` is a plain dense simplex with
Bland's rule, written here rather than adding a solver dependency for one bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from driver.catalog import GpuModel, gpu_model
from driver.geometry import EMPTY_STATE, GpuState, geometry_for
from tests.bench.alibaba import MappedRequest, TraceNode, catalogue_model
from tests.bench.replay import Job

WHOLE = "gpu"


def configurations(model: GpuModel, profiles: Sequence[str]) -> list[dict[str, int]]:
    """The maximal multisets of ``profiles`` (names on ``model``) that one GPU can hold at
    once, plus the whole GPU (``{"gpu": 1}``)."""
    geometry = geometry_for(model)
    ids = {p.id: p.name for p in model.profiles if p.name in profiles}
    seen: set[GpuState] = {EMPTY_STATE}
    frontier = [EMPTY_STATE]
    while frontier:
        state = frontier.pop()
        for pid in ids:
            for start in geometry.feasible_starts(state, pid):
                child = geometry.place(state, pid, start)
                if child not in seen:
                    seen.add(child)
                    frontier.append(child)
    vectors = set()
    for state in seen:
        counts: dict[str, int] = {}
        for pid, _ in state.instances:
            counts[ids[pid]] = counts.get(ids[pid], 0) + 1
        vectors.add(tuple(sorted(counts.items())))
    as_dicts = [dict(v) for v in vectors]
    maximal = [
        c
        for c in as_dicts
        if not any(o != c and all(o.get(k, 0) >= n for k, n in c.items()) for o in as_dicts)
    ]
    return [*sorted(maximal, key=lambda c: sorted(c.items())), {WHOLE: 1}]


def maximise(
    objective: Sequence[float], rows: Sequence[Sequence[float]], limits: Sequence[float]
) -> float:
    """max c.x subject to A x <= b, x >= 0, for b >= 0 (the slack basis is feasible)."""
    m, n = len(rows), len(objective)
    if any(b < 0 for b in limits):
        raise ValueError("limits must be non-negative")
    # Tableau: m constraint rows [A | I | b], then the objective row [-c | 0 | 0].
    table = [[*rows[i], *(1.0 if j == i else 0.0 for j in range(m)), limits[i]] for i in range(m)]
    table.append([*(-c for c in objective), *(0.0 for _ in range(m)), 0.0])
    basis = list(range(n, n + m))
    eps = 1e-9
    for _ in range(50_000):
        last = table[-1]
        entering = next((j for j in range(n + m) if last[j] < -eps), None)  # Bland
        if entering is None:
            return table[-1][-1]
        best: tuple[float, int, int] | None = None
        for i in range(m):
            a = table[i][entering]
            if a > eps:
                ratio = table[i][-1] / a
                key = (ratio, basis[i], i)
                if best is None or key < best:
                    best = key
        if best is None:
            raise ValueError("unbounded")
        row = best[2]
        pivot = table[row][entering]
        table[row] = [v / pivot for v in table[row]]
        for i in range(m + 1):
            if i != row and abs(table[i][entering]) > eps:
                f = table[i][entering]
                table[i] = [v - f * w for v, w in zip(table[i], table[row], strict=True)]
        basis[row] = entering
    raise RuntimeError("simplex did not converge")


@dataclass(frozen=True)
class LpBound:
    share: float
    jobs: float


@dataclass(frozen=True)
class ModelCapacity:
    """What the nodes of one GPU model hold together."""

    gpus: int
    cpu_milli: float
    memory_mib: float


@dataclass(frozen=True)
class Demand:
    """Jobs of one request type: how many, and the least cpu and memory one of them asks (the
    least is what keeps the node rows a valid relaxation, whichever jobs are chosen)."""

    count: float
    cpu_milli: float
    memory_mib: float


def configuration_bound(nodes: Sequence[TraceNode], jobs: Sequence[Job]) -> LpBound:
    """The configuration LP's optimum for the placed GPU share and for the placed job count."""
    per_model: dict[str, list[TraceNode]] = {}
    for n in nodes:
        per_model.setdefault(catalogue_model(n.model).key, []).append(n)
    capacity = {
        m: ModelCapacity(
            sum(n.gpus for n in ns), sum(n.cpu_milli for n in ns), sum(n.memory_mib for n in ns)
        )
        for m, ns in per_model.items()
    }
    return configuration_lp(
        capacity,
        demand_of(
            (j.request, j.needs.requests.cpu_milli, j.needs.requests.memory / 2**20) for j in jobs
        ),
    )


def demand_of(jobs: Iterable[tuple[MappedRequest, float, float]]) -> dict[MappedRequest, Demand]:
    """(request, cpu milli, memory MiB) per job -> the demand per request type."""
    acc: dict[MappedRequest, list[float]] = {}
    for request, cpu, memory in jobs:
        a = acc.setdefault(request, [0.0, float("inf"), float("inf")])
        a[0] += 1
        a[1] = min(a[1], cpu)
        a[2] = min(a[2], memory)
    return {r: Demand(*a) for r, a in acc.items()}


def configuration_lp(
    capacity: Mapping[str, ModelCapacity], demand: Mapping[MappedRequest, Demand]
) -> LpBound:
    """The configuration LP (module docstring) for GPUs per model and jobs per request type."""
    by_request = {r: [d.count, d.cpu_milli, d.memory_mib] for r, d in demand.items()}
    requests = sorted(by_request, key=lambda r: (r.whole, r.count, r.profiles, r.models))
    models = sorted(capacity)
    configs = {
        m: configurations(
            gpu_model(m), sorted({p for r in requests if (p := r.profile_on(m)) is not None})
        )
        for m in models
    }
    columns: list[tuple[str, object, object]] = []  # ("x", model, config index) / ("z", r, m)
    for m in models:
        columns.extend(("x", m, i) for i in range(len(configs[m])))
    for r in requests:
        columns.extend(("z", r, m) for m in models if m in r.models)
    index = {c: i for i, c in enumerate(columns)}
    rows: list[list[float]] = []
    limits: list[float] = []

    def row() -> list[float]:
        rows.append([0.0] * len(columns))
        return rows[-1]

    for m in models:
        r0 = row()
        for i in range(len(configs[m])):
            r0[index[("x", m, i)]] = 1.0
        limits.append(float(capacity[m].gpus))
        for p in sorted({k for c in configs[m] for k in c}):
            rp = row()
            for i, c in enumerate(configs[m]):
                rp[index[("x", m, i)]] = -float(c.get(p, 0))
            for r in requests:
                if m in r.models and (r.profile_on(m) == p or (r.whole and p == WHOLE)):
                    rp[index[("z", r, m)]] = float(r.count)
            limits.append(0.0)
        cpu, mem = row(), row()
        for r in requests:
            if m in r.models:
                _, least_cpu, least_memory = by_request[r]
                cpu[index[("z", r, m)]] = least_cpu
                mem[index[("z", r, m)]] = least_memory
        limits.append(float(capacity[m].cpu_milli))
        limits.append(float(capacity[m].memory_mib))
    for r in requests:
        rr = row()
        for m in models:
            if m in r.models:
                rr[index[("z", r, m)]] = 1.0
        limits.append(by_request[r][0])

    def solve(weight: Mapping[MappedRequest, float]) -> float:
        objective = [weight[c[1]] if c[0] == "z" else 0.0 for c in columns]  # type: ignore[index]
        return maximise(objective, rows, limits)

    share = solve({r: r.share for r in requests})
    count = solve(dict.fromkeys(requests, 1.0))
    return LpBound(share, count)
