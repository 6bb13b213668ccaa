"""Reading figures out of Prometheus text exposition (the controller's and kube-apiserver's
/metrics): counters summed over matching series, and quantiles of a histogram's increase
between two scrapes, interpolated inside buckets as PromQL's histogram_quantile does."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def samples(text: str, name: str) -> list[Sample]:
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None or m.group(1) != name:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.append(Sample(name, labels, float(m.group(4))))
    return out


def counter_sum(text: str, name: str, **match: str) -> float:
    """Sum of every series of `name` whose labels include `match`."""
    return sum(
        s.value for s in samples(text, name) if all(s.labels.get(k) == v for k, v in match.items())
    )


def buckets(text: str, histogram: str) -> dict[float, float]:
    """Cumulative bucket counts by upper bound (+Inf included)."""
    return {
        float(s.labels["le"]): s.value
        for s in samples(text, f"{histogram}_bucket")
        if "le" in s.labels
    }


def quantile(before: Mapping[float, float], after: Mapping[float, float], q: float) -> float:
    """The q-quantile of the observations made between two scrapes; NaN when there were none.
    Inside a bucket the value is interpolated linearly; in the +Inf bucket it is the largest
    finite bound (a lower bound on the truth)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            if inside <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / inside
        lower_bound, lower_count = bound, count
    return lower_bound
