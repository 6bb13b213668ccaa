"""Scale: the real carve-controller against a real apiserver holding N fake GPU nodes, with churn.

Run: python -m bench.scale [--nodes 100,300,1000] [--rate 200] [--duration 30] [--hold 10]
                           [--compare before=/path/to/old/tree]

One private v1.37 control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager
with its node-lifecycle controller) is started; `bench.gpufleet` grows it to each node count in
turn (8 GPUs a node, the plugin's exact ResourceSlices, Leases renewed every 10 s, no plugin or
kubelet process). At each size a fresh `carve-controller` process starts against the full fleet
and pods are churned: created at `--rate` per second with a claim from a ResourceClaimTemplate
(1g, 1g, 2g, 3g slices in turn), gated by carve's admission policy, placed by carve, bound by the
real kube-scheduler, and force-deleted `--hold` seconds after binding (no kubelet runs them).
kube-scheduler's and kube-controller-manager's client rate limits are raised to
`--control-plane-qps` (200 by default, as providers do for large clusters): at their defaults
(50 and 20 requests/s) claim generation alone caps arrivals near 10 pods per second.

"Placed" means carve removed the pod's scheduling gate, which it does only after writing the
allocation of every carve claim of the pod; "bound" means kube-scheduler set spec.nodeName.

Printed per size (and per controller with --compare, which runs the controller from another
source tree, e.g. `git worktree add` of an older commit, on the same fleet in the same session):
- decision p50/p99: the controller's own `carve_decision_seconds` histogram (the placement
  engine's time per pod, wall clock), over the churn; cpu p99: `carve_decision_cpu_seconds`,
  the same decisions in the deciding thread's CPU time, so that a tail of waiting for a CPU
  or the GIL shows as the gap between the two;
- placement and binding rate: pods placed (bound) per second while pods arrive, and over the
  whole run including the drain after the last pod was created;
- controller RSS from /proc (after start-up, and the peak during churn);
- start-up: process start to /readyz, and to a pod created beforehand being placed (lists
  done, every node's GPUs in the model, first decision made);
- queue/s (with --backlog N): N pods are created, and their claims generated, before each
  controller starts; the figure is the rate from the first to the last of their placements,
  which no pod creator's speed limits; cpu/pl is the controller's CPU time (ms, user and
  system, from /proc) per placement while it placed them;
- with --controller-cpus N the controller runs on N CPUs of its own and everything else (the
  control plane, the fleet's Lease renewals, the pod creators) on the rest: decision wall
  time then shows what a controller with its own CPU gets, without the control plane's
  processes in its run queue (on a real cluster they run on other machines);
- the backlog's progress line also says how fast the control plane alone (no controller
  running) admitted its pods and generated their claims, with --creators threads;
- apiserver requests per placement: kube-apiserver's API Priority and Fairness counter
  `apiserver_flowcontrol_dispatched_requests_total` for a FlowSchema that matches only the
  controller's own user (the apiserver's request counters carry no client label).

Figures are printed, not asserted (tests/bench/test_scale.py runs the machinery on a small
fleet and checks only that it works).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.support.scale import (
    HEADER,
    ScaleBench,
    ScaleConfig,
    ScaleFigures,
    figures_json,
    format_row,
)
from tests.support.scale_burst import BurstFigures, summary_line
from tests.support.scale_pods import PROFILES

# -- report ------------------------------------------------------------------------------------


def print_report(
    figures: Sequence[ScaleFigures], cfg: ScaleConfig, native: Sequence[BurstFigures] = ()
) -> None:
    print(
        f"scale: pods offered at {cfg.rate:g}/s for {cfg.duration_s:g}s "
        f"({'/'.join(PROFILES)} slices), deleted {cfg.hold_s:g}s after binding; "
        f"decision = carve_decision_seconds (ms); placed = gate removed after allocation"
    )
    if cfg.controller_cpus:
        print(f"the controller ran alone on CPUs {sorted(cfg.controller_cpus)}")
    print(HEADER)
    for f in figures:
        print(format_row(f))
    labels = [label for label, _ in cfg.controllers]
    if len(labels) > 1:
        base = labels[0]
        print(f"ratios to '{base}' (same fleet, same session):")
        for f in figures:
            if f.controller == base:
                continue
            b = next((g for g in figures if g.controller == base and g.nodes == f.nodes), None)
            if b is None:
                continue
            print(
                f"  {f.controller} @ {f.nodes} nodes: RSS x{f.rss_peak_mb / b.rss_peak_mb:.2f}, "
                f"first placement x{f.model_s / b.model_s:.2f}, "
                f"decision p99 x{_ratio(f.decision_p99_ms, b.decision_p99_ms)}, "
                f"placed/s x{_ratio(f.overall_rate, b.overall_rate)}, "
                f"queue/s x{_ratio(f.backlog_rate, b.backlog_rate)}, "
                f"requests/pod x{_ratio(f.requests_per_pod, b.requests_per_pod)}"
            )
    for f in figures:
        if f.burst is not None:
            print(f.burst.describe())
    for n in native:
        print(n.describe())
    for f in figures:
        if f.controller != "this" or f.burst is None:
            continue
        same = [n for n in native if n.nodes == f.nodes]
        if same:
            print(summary_line(f.nodes, f.burst, same[0], f.rss_peak_mb))


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not math.isnan(a) and not math.isnan(b) else "n/a"


def compared_controllers(specs: Sequence[str]) -> tuple[tuple[str, Path | None], ...]:
    """`--compare LABEL=TREE` arguments as (label, tree), then this tree's controller."""
    out: list[tuple[str, Path | None]] = []
    for spec in specs:
        label, _, path = spec.partition("=")
        if not path or not (Path(path) / "controller" / "main.py").exists():
            raise SystemExit(
                f"--compare {spec!r}: expected LABEL=TREE with TREE/controller/main.py"
            )
        out.append((label, Path(path).resolve()))
    out.append(("this", None))
    return tuple(out)


def _split_cpus(count: int) -> frozenset[int]:
    """The last `count` CPUs this process may use, for the controller alone."""
    if count <= 0:
        return frozenset()
    cpus = sorted(os.sched_getaffinity(0))
    if count >= len(cpus):
        raise SystemExit(
            f"--controller-cpus {count}: this process may use {len(cpus)} CPUs "
            f"({cpus}); at least one must be left for the control plane"
        )
    return frozenset(cpus[-count:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,300,1000", help="comma-separated node counts")
    parser.add_argument("--rate", type=float, default=200.0, help="pods created per second")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of pod arrivals")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds a bound pod lives")
    parser.add_argument("--drain", type=float, default=90.0, help="seconds to wait for stragglers")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=TREE",
        help="also run the controller from another source tree (runs first at every size)",
    )
    parser.add_argument(
        "--plain-pods-per-node",
        type=int,
        default=0,
        help="pods of other workloads (no claims) bound to every node",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        help="pods created, with their claims, before each controller starts: 'queue/s' is "
        "the rate at which it places them (its own rate, not the pod creators')",
    )
    parser.add_argument(
        "--control-plane-qps",
        type=float,
        default=200.0,
        help="client rate limit (requests/s, burst twice that) of kube-scheduler and "
        "kube-controller-manager; 0 keeps their defaults of 50 and 20, at which claim "
        "generation caps arrivals near 10 pods/s",
    )
    parser.add_argument(
        "--creators",
        type=int,
        default=4,
        help="threads creating pods (each waits for the apiserver's answer before its next)",
    )
    parser.add_argument(
        "--controller-cpus",
        type=int,
        default=0,
        help="give the controller this many CPUs of its own (the last ones this process may "
        "use) and run everything else on the rest, as a controller with a CPU of its own on "
        "a real cluster runs; 0: all share every CPU",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=1000,
        help="pods created at once after the churn, on the carve path (per controller) and on "
        "the native path (kube-scheduler alone, no controller running); 0: no burst",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    controller_cpus = _split_cpus(args.controller_cpus)
    cfg = ScaleConfig(
        node_counts=tuple(sorted(int(n) for n in args.nodes.split(","))),
        rate=args.rate,
        duration_s=args.duration,
        hold_s=args.hold,
        drain_s=args.drain,
        plain_pods_per_node=args.plain_pods_per_node,
        backlog=args.backlog,
        controllers=compared_controllers(args.compare),
        creators=args.creators,
        controller_cpus=controller_cpus,
        burst=args.burst,
    )
    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster

    if controller_cpus:
        # Before anything starts: the control plane, the fleet and the pod creators inherit it.
        os.sched_setaffinity(0, os.sched_getaffinity(0) - controller_cpus)
        print(
            f"scale: the controller runs on CPUs {sorted(controller_cpus)}, the rest on "
            f"{sorted(os.sched_getaffinity(0))}",
            file=sys.stderr,
        )
    root = Path(tempfile.mkdtemp(prefix="carve-scale-"))
    cluster = LocalCluster(root / "cluster", client_qps=args.control_plane_qps or None)
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"scale: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    bench = ScaleBench(info, root, cfg)
    figures: list[ScaleFigures] = []
    try:
        bench.install()
        for n in cfg.node_counts:
            figures.extend(bench.run_size(n))
    finally:
        bench.close()
        print_report(figures, cfg, bench.native)
        if args.json:
            args.json.write_text(figures_json(figures, bench.native))
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
