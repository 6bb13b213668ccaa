"""The end-to-end packing runs' JSON files (``python -m bench.cluster_packing --json``), the
ratio lines a run ends with (each carve arm over each scheduler arm), and the summary over
several runs (``--summarize``): per workload and arm, the mean and the range over the runs,
and each carve arm's ratios to each scheduler arm, taken within each run.

Runs of one workload are grouped by its name (a mix's seeds share it, so several seeds make one
summary); they need not have the same arms."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.bench.cluster_figures import ArmFigures, ClassWaits, ceiling, headroom_closed
from tests.bench.cluster_workload import Workload


def to_json(workload: Workload, head: Sequence[str], figures: Sequence[ArmFigures]) -> str:
    return json.dumps(
        {
            "workload": workload.name,
            "head": list(head),
            "arms": [dataclasses.asdict(f) for f in figures],
        },
        indent=1,
    )


def from_json(data: Mapping[str, Any]) -> list[ArmFigures]:
    out = []
    for saved in data["arms"]:
        a = dict(saved)
        a["waits"] = {c: ClassWaits(**w) for c, w in a["waits"].items()}
        a["large"] = ClassWaits(**a["large"])
        a["notes"] = tuple(a.get("notes") or ())
        out.append(ArmFigures(**a))
    return out


def summarize(paths: Sequence[Path]) -> list[str]:
    """Mean and range over runs, per workload and arm, and the in-run ratios. Runs need not
    have the same arms (carve with the default profile in one, with bin-packing in the next):
    each arm is summarized over the runs that have it, each ratio over the runs that have both
    arms, and every line says how many runs it is over."""
    runs: dict[str, list[list[ArmFigures]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        runs.setdefault(data["workload"], []).append(from_json(data))
    lines: list[str] = []
    for workload, per_run in runs.items():
        lines.append(f"{workload}: {len(per_run)} runs")
        by_arm = [{f.arm: f for f in run} for run in per_run]
        arms = list(dict.fromkeys(arm for run in by_arm for arm in run))
        for arm in arms:
            got = [run[arm] for run in by_arm if arm in run]
            lines.append(
                f"  {arm:<22} {len(got)} runs: share {_spread([f.share for f in got])}  /bound "
                f"{_spread([f.of_bound for f in got])}  jobs "
                f"{_spread([f.placed_fraction for f in got])}"
                f"  frag {_spread([f.frag for f in got])}  large p99 "
                f"{_spread([f.large.p99 for f in got], '.0f')}s  7g p99 "
                f"{_spread([f.waits['7g'].p99 for f in got], '.0f')}s  multi-GPU p99 "
                f"{_spread([f.waits['multi-GPU'].p99 for f in got], '.0f')}s"
            )
        for arm in (a for a in arms if a.startswith("carve")):
            for peer in (a for a in arms if a.startswith("scheduler-")):
                pairs = [(run[arm], run[peer]) for run in by_arm if arm in run and peer in run]
                if pairs:
                    lines.append(_ratio_line(arm, peer, pairs))
    return lines


def _spread(values: Sequence[float], fmt: str = ".3f") -> str:
    """``mean [min-max]`` of the values that are numbers."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    return f"{statistics.fmean(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _ratio_line(arm: str, peer: str, pairs: Sequence[tuple[ArmFigures, ArmFigures]]) -> str:
    def ratio(pick: Callable[[ArmFigures], float]) -> str:
        return _spread([_div(pick(a), pick(b)) for a, b in pairs])

    return (
        f"  {arm} / {peer} ({len(pairs)} runs): share x{ratio(lambda f: f.share)}, "
        f"large p99 x{ratio(lambda f: f.large.p99)}, "
        f"7g p99 x{ratio(lambda f: f.waits['7g'].p99)}, "
        f"multi-GPU p99 x{ratio(lambda f: f.waits['multi-GPU'].p99)}; share ceiling "
        f"x{_spread([ceiling(a, b) for a, b in pairs])}, headroom closed "
        f"{_spread([headroom_closed(a, b) for a, b in pairs], '.2f')}"
    )


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def ratios(figures: Sequence[ArmFigures]) -> list[str]:
    """Each carve arm against each scheduler arm, in this run."""
    out = []
    peers = [f for f in figures if f.arm.startswith("scheduler-")]
    for f in figures:
        if not f.arm.startswith("carve"):
            continue
        for p in peers:
            out.append(
                f"{f.arm} vs {p.arm}: share x{_ratio(f.share, p.share)}, jobs "
                f"x{_ratio(f.placed_fraction, p.placed_fraction)}, large p99 wait "
                f"x{_ratio(f.large.p99, p.large.p99)}, 7g p99 "
                f"x{_ratio(f.waits['7g'].p99, p.waits['7g'].p99)}, multi-GPU p99 "
                f"x{_ratio(f.waits['multi-GPU'].p99, p.waits['multi-GPU'].p99)}; share "
                f"ceiling x{ceiling(f, p):.3f}, headroom closed {headroom_closed(f, p):.2f}"
            )
    return out


def _ratio(a: float, b: float) -> str:
    r = _div(a, b)
    return "n/a" if math.isnan(r) else f"{r:.3f}"
