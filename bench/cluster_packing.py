"""End-to-end packing through the real control plane: carve's controller against the real
kube-scheduler v1.37.2, on the same arrivals, in one run.

    python -m bench.cluster_packing --mix inference --seed 1            # the MIG-native mix
    python -m bench.cluster_packing --seed 1 \
        --trace ../shared/traces/alibaba-gpu-v2023/openb_pod_list_default.csv
    python -m bench.cluster_packing --list-mixes
    python -m bench.cluster_packing --summarize run1.json run2.json ...   # runs side by side

One private control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler
v1.37.2), then every arm at the same time, each on its own copy of the workload's fleet
(``tests.support.gpufleet`` nodes: Node objects with the workload's cpu and memory, Leases
renewed, the exact ResourceSlices carve's plugin publishes for the workload's GPU models; each
copy labelled for its arm, which its pods select):

- ``carve`` (the controller's default policy) or ``carve-<policy>`` (``fill-holes``,
  ``best-fit``, ``least-waste``, ``first-fit``), at most one per run: a fresh carve-controller
  with ``--packing-policy``; pods gated by carve's admission policy, claims of carve's
  DeviceClasses; a kube-scheduler of the arm's own (default profile) binds what carve placed;
- ``scheduler-default``: no carve; pods not gated, claims of two DeviceClasses outside carve's
  set that select the same partitionable devices, placed by a kube-scheduler of the arm's own
  running kube-scheduler's default profile (NodeResourcesFit LeastAllocated on cpu and memory
  and its other default plugins pick the node, its DRA allocator the devices): what a user gets
  on the native path;
- ``scheduler-binpack``: the same with a profile whose NodeResourcesFit scores MostAllocated.

Every arm's profile is printed at the head of every run, as the KubeSchedulerConfiguration
its kube-scheduler runs (none uses the cluster's own, whose leader election can lose its lease
on a loaded machine and exit). Arms run side by side because this is a
shared machine whose load moves by the minute: one after the other they would each meet a
different machine (``tests.support.cluster_packing`` says what they share and what not).

Each arm gets the same jobs (``tests.bench.cluster_workload``: arrival times, lifetimes, cpu and
memory, one ResourceClaim from a template per job), in a namespace of its own. A pod is created
at its arrival time, deleted ``lifetime`` seconds after it was seen bound, and the node side is
played by ``tests.support.cluster_packing.NodeStandIn``, which adds and removes the node's
finalizer as the plugin does, so carve's release handshake and the native path's claim deletion
run as on a real cluster. An arm ends once every job was bound, or ``--drain`` seconds after
the last arrival.

Workloads: ``--trace PATH`` (any file of the Alibaba GPU trace's format; the mapping onto MIG is
printed) or ``--mix NAME`` (``tests.bench.mig_mix``; ``--list-mixes`` prints the names, the
default first, and the chosen mix is printed parameter by parameter). ``--seed`` picks the
trace's stretch, or draws the mix. ``--jobs``, ``--rate``, ``--load``, ``--window-from``,
``--min-run`` and ``--max-run`` set the time scale (``tests.bench.cluster_workload``).

The figures (definitions in ``tests.bench.cluster_figures`` and under the table) are computed
after the run from what it recorded. The run ends with one line per arm:

    arm=<name> share=<placed GPU share> jobs=<fraction placed> large_p99_wait_s=<seconds>

``--json PATH`` writes the figures; ``--summarize`` prints several such files side by side,
per workload and arm, with the mean and the range over the runs, and each carve arm's ratio to
each scheduler arm, taken within each run (``tests.bench.cluster_runs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.bench.alibaba import CITATION, NODE_FILE, TRACE_DIR, load_nodes, load_tasks
from tests.bench.cluster_figures import ArmFigures, ClassWaits, arm_figures, fleet_model
from tests.bench.cluster_runs import ratios, summarize, to_json
from tests.bench.cluster_workload import SIZE_CLASSES, Timing, Workload, describe, trace_workload
from tests.bench.mig_mix import MIXES, describe_mix, mix_named, mix_workload
from tests.support.cluster_packing import ArmSettings, ClusterPacking
from tests.support.packing_arms import parse_arms

DEFAULT_ARMS = "carve,scheduler-default,scheduler-binpack"
LAG_LIMIT_S = 5.0
"""Creators later than this (p99) mean the control plane could not keep up with the arrivals."""


def build_workload(args: argparse.Namespace, timing: Timing) -> tuple[Workload, list[str]]:
    """The workload and the lines that describe it."""
    if args.trace is not None:
        w = trace_workload(
            args.trace.name,
            load_tasks(args.trace),
            load_nodes(args.node_file),
            node_count=args.nodes,
            timing=timing,
            seed=args.seed,
        )
        return w, [f"trace: {CITATION}", *describe(w, timing)]
    mix = mix_named(args.mix or MIXES[0].name)
    w = mix_workload(mix, args.nodes, timing, args.seed)
    return w, [*describe_mix(mix), *describe(w, timing)]


# ---------------------------------------------------------------------------------------------
# Tables


def _wait(w: ClassWaits) -> str:
    if not w.jobs:
        return "-"
    more = "+" if w.unplaced else ""  # some waits are lower bounds
    return f"{w.p50:.0f}/{w.p99:.0f}{more}"


def table(figures: Sequence[ArmFigures]) -> list[str]:
    head = (
        f"{'arm':<26}{'share':>7}{'/bound':>7}{'bound':>7}{'jobs':>7}{'by hor.':>8}{'util':>6}"
        f"{'frag':>6}"
        + "".join(f"{'wait ' + c:>15}" for c in SIZE_CLASSES)
        + f"{'large p99':>10}{'max large':>10}"
    )
    lines = [head]
    for f in figures:
        lines.append(
            f"{f.arm:<26}{f.share:>7.3f}{f.of_bound:>7.3f}{f.bound:>7.3f}"
            f"{f.placed_fraction:>7.3f}{f.placed_by_horizon / f.jobs:>8.3f}{f.util:>6.3f}"
            f"{f.frag:>6.3f}"
            + "".join(f"{_wait(f.waits[c]):>15}" for c in SIZE_CLASSES)
            + f"{f.large.p99:>10.1f}{f.max_large_wait:>10.1f}"
        )
    return lines


LEGEND = (
    "share: GPU share held by running jobs over the window / GPUs; /bound: share over "
    "bound (fluid and configuration LP of the jobs present); jobs: bound before the arm ended; "
    "by hor.: bound by the last arrival; util: memory slices held; frag: free share on nodes "
    "that cannot host the largest waiting request / GPUs; waits: p50/p99 seconds (+: some jobs "
    "never bound, their waits are lower bounds); large: 7g and multi-GPU; share ceiling: carve's "
    "bound over the scheduler's share, the most any packer could have held over it; headroom "
    "closed: (carve's share - the scheduler's) / (carve's bound - the scheduler's share)"
)


def in_process(args: argparse.Namespace, workload: Workload, head: Sequence[str]) -> int:
    """The workload through carve's engine alone, one policy after the other."""
    from controller.placement import Policy
    from tests.bench.cluster_inprocess import replay

    for line in head:
        print(line, flush=True)
    end = workload.last_arrival + args.drain
    figures = []
    for name in (p.strip() for p in args.in_process.split(",") if p.strip()):
        records = replay(workload, Policy(name), end)
        figures.append(
            arm_figures(
                f"carve-{name}-in-process", workload, records, fleet_model(workload.nodes), end
            )
        )
    print("in process: carve's engine on a model of one fleet, the queue of tests.bench.queued")
    for line in table(figures):
        print(line)
    print(LEGEND)
    if args.json:
        args.json.write_text(to_json(workload, head, figures))
    for f in figures:
        print(f.summary_line())
    return 0


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster_packing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a task list of the Alibaba trace's format")
    source.add_argument("--mix", help=f"a MIG-native mix (default {MIXES[0].name})")
    source.add_argument("--list-mixes", action="store_true", help="print the mixes and exit")
    source.add_argument(
        "--summarize", type=Path, nargs="+", help="print runs' --json files side by side"
    )
    parser.add_argument("--node-file", type=Path, default=TRACE_DIR / NODE_FILE)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument(
        "--arms", default=DEFAULT_ARMS, help="comma-separated; at most one carve arm"
    )
    defaults = Timing()
    parser.add_argument("--jobs", type=int, default=defaults.jobs)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="arrivals per second")
    parser.add_argument(
        "--load", type=float, default=defaults.load, help="offered load over the window"
    )
    parser.add_argument(
        "--window-from",
        type=float,
        default=defaults.window_from,
        help="where the measured window starts, as a fraction of the arrival span",
    )
    parser.add_argument("--min-run", type=float, default=defaults.min_run)
    parser.add_argument("--max-run", type=float, default=defaults.max_run)
    settings = ArmSettings()
    parser.add_argument("--drain", type=float, default=settings.drain_s)
    parser.add_argument("--destroy", type=float, default=settings.destroy_s)
    parser.add_argument("--creators", type=int, default=settings.creators)
    parser.add_argument("--control-plane-qps", type=float, default=200.0)
    parser.add_argument(
        "--in-process",
        metavar="POLICIES",
        help="no control plane: replay the workload through carve's engine in process with "
        "these packing policies (comma-separated, e.g. best-fit,least-waste,fill-holes) and "
        "print the same figures; seconds, repeatable (tests/bench/cluster_inprocess.py)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--workdir", type=Path, help="keep the control plane's logs here (default: a temp dir)"
    )
    args = parser.parse_args(argv)

    if args.list_mixes:
        for m in MIXES:
            print(m.name)
        return 0
    if args.summarize:
        print("\n".join(summarize(args.summarize)))
        return 0
    try:
        arms = parse_arms(args.arms)
        timing = Timing(
            args.jobs, args.rate, args.load, args.window_from, args.min_run, args.max_run
        )
        workload, head = build_workload(args, timing)
    except ValueError as exc:
        parser.error(str(exc))
    if args.in_process is not None:
        return in_process(args, workload, head)
    for arm in arms:
        role = "binds what carve placed" if arm.carve else "places the pods"
        head.append(
            f"{arm.name}: a kube-scheduler of its own ({role}), KubeSchedulerConfiguration "
            f"(kubescheduler.config.k8s.io/v1) profiles: {json.dumps([arm.profile])}"
        )
    head.append(
        f"{len(arms)} arms at once, each on its own copy of the fleet; {args.creators} "
        f"creators per arm; drain {args.drain:g}s; stand-in destroy {args.destroy:g}s"
    )
    for line in head:
        print(line, flush=True)

    from devcluster.binaries import BinariesUnavailableError
    from devcluster.cluster import LocalCluster

    begin = time.monotonic()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="carve-cluster-packing-"))
    cluster = LocalCluster(root / "cluster", client_qps=args.control_plane_qps or None)
    try:
        info = cluster.start()
    except BinariesUnavailableError as exc:
        print(f"cluster_packing: control plane unavailable: {exc}", file=sys.stderr)
        return 2
    bench = ClusterPacking(
        info,
        root,
        workload,
        arms,
        settings=ArmSettings(drain_s=args.drain, destroy_s=args.destroy, creators=args.creators),
        client_qps=args.control_plane_qps or None,
    )
    figures: list[ArmFigures] = []
    try:
        took = bench.install()
        print(f"fleets ready in {took:.0f}s", file=sys.stderr, flush=True)
        runs = bench.run()
        print(
            f"fleet: {bench.fleet.renew_failures} Lease renewals failed, Ready posted again "
            f"{bench.fleet.ready_again} times (node-lifecycle had lost the node)",
            file=sys.stderr,
        )
    finally:
        bench.close()
        cluster.stop()
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    for run in runs:
        f = arm_figures(run.arm, workload, run.records, fleet_model(workload.nodes), run.end)
        notes = [*f.notes, *run.notes, f"creators' lag p99 {run.create_lag_p99:.2f}s"]
        if run.create_lag_p99 > LAG_LIMIT_S:
            notes.append(
                f"WARNING: the control plane fell behind the arrivals (creators' lag p99 "
                f"{run.create_lag_p99:.1f}s > {LAG_LIMIT_S:g}s): this arm measured the "
                "machine's throughput as much as packing"
            )
        figures.append(dataclasses.replace(f, notes=tuple(notes)))
    print()
    for line in table(figures):
        print(line)
    print(LEGEND)
    for f in figures:
        print(f"  {f.arm}: {'; '.join(f.notes)}")
    for line in ratios(figures):
        print(line)
    print(f"run took {time.monotonic() - begin:.0f}s")
    if args.json:
        args.json.write_text(to_json(workload, head, figures))
    for f in figures:
        print(f.summary_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
