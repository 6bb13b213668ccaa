"""`python -m bench.cluster_packing`'s machinery on a tiny fleet, so the end-to-end replay cannot
rot: on the bench suite's control plane (tests/bench/conftest.py), the default arms at once
(carve, and two kube-schedulers of their own with the default and the bin-packing profile), each
on two fake GPU nodes, a dozen jobs.

Only the mechanics are checked (every job created on time, bound, run for its lifetime, its
devices recorded and never shared, the node's finalizer handshake done, the right allocator
and profile at work, nothing left behind), never the packing figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kubernetes.client import CoreV1Api

from devcluster.cluster import LocalCluster, api_client_for
from driver.catalog import gpu_model
from tests.bench.cluster_figures import arm_figures, fleet_model
from tests.bench.cluster_workload import Timing, Workload
from tests.bench.mig_mix import INFERENCE, mix_workload
from tests.support.cluster_packing import ArmRun, ArmSettings, ClusterPacking
from tests.support.packing_arms import parse_arms

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SUMMARY = re.compile(r"arm=\S+ share=\d\.\d{4} jobs=\d\.\d{4} large_p99_wait_s=\d+\.\d")


def _check_arm(workload: Workload, run: ArmRun) -> None:
    jobs = {j.name: j for j in workload.jobs}
    nodes = {n.name: n for n in workload.nodes}
    assert set(run.records) == set(jobs), "every job's pod was created"
    assert not [n for n in run.notes if "left behind" in n or "stand-in" in n], run.notes
    held: list[tuple[float, float, str, str]] = []  # (bound, ended, device, job)
    for name, rec in run.records.items():
        job = jobs[name]
        assert rec.bound is not None, f"{name} was never bound"
        if rec.ended is not None:
            assert rec.ended >= rec.bound + job.lifetime - 0.01, "deleted after its lifetime"
        assert rec.node in nodes, "bound to a fleet node"
        model = nodes[rec.node].model
        assert model in job.request.models
        assert rec.devices, f"the node saw {name}'s allocation"
        assert {d.pool for d in rec.devices} == {rec.node}
        if job.request.whole:
            assert len(rec.devices) == job.request.count
            assert all("-mig-" not in d.device for d in rec.devices)
        else:
            [device] = rec.devices
            profile = job.request.profile_on(model)
            assert profile is not None
            assert f"-mig-{profile.replace('.', '')}-" in device.device
            assert gpu_model(model).key == model
        ended = run.end if rec.ended is None else rec.ended
        held += [(rec.bound, ended, d.device + "@" + rec.node, name) for d in rec.devices]
    assert sum(1 for r in run.records.values() if r.ended is not None) >= len(jobs) // 4
    held.sort()
    for i, (_, end, where, name) in enumerate(held):
        for start2, _end2, where2, name2 in held[i + 1 :]:
            if start2 >= end:
                break
            assert where2 != where, f"{name} and {name2} held {where} at once"
    # One claim per job: the node's finalizer went on when it was bound and came off after.
    assert run.handshakes == (len(jobs), len(jobs))


def test_the_replay_runs_every_default_arm_at_once_on_the_same_jobs(
    k8s_cluster: LocalCluster, tmp_path: Path
) -> None:
    # Lifetimes of 3 s: long enough for the node stand-in to see every claim before its pod goes.
    timing = Timing(jobs=12, rate=2.0, load=0.5, window_from=0.0, min_run=3.0, max_run=3.0)
    workload = mix_workload(INFERENCE, 2, timing, seed=3)
    arms = parse_arms("carve,scheduler-default,scheduler-binpack")
    bench = ClusterPacking(
        k8s_cluster.info,
        tmp_path,
        workload,
        arms,
        settings=ArmSettings(drain_s=60.0, destroy_s=0.5, creators=2),
    )
    try:
        bench.install()
        runs = bench.run()
        binpack_work = bench.schedulers["scheduler-binpack"].work()
    finally:
        bench.close()
    carve, default, binpack = runs
    assert [r.arm for r in runs] == [a.name for a in arms]
    for run in runs:
        _check_arm(workload, run)
    assert carve.carve_allocated == set(carve.records), "carve allocated every claim"
    for run in (default, binpack):
        assert not run.carve_allocated, "kube-scheduler allocated the native path's claims"
    # Each arm's own kube-scheduler scheduled its pods through the arm's profile; carve's only
    # bound them, so the cluster's kube-scheduler (leader-elected) never held an arm up.
    for run in runs:
        assert run.scheduled_by_profile >= len(workload.jobs), run.arm
    assert binpack_work.scheduled == binpack.scheduled_by_profile
    nodes = CoreV1Api(api_client_for(Path(k8s_cluster.info.kubeconfig))).list_node()
    names = [str(n.metadata.name) for n in nodes.items if n.metadata is not None]
    assert not [n for n in names if n.startswith(("a0-", "a1-", "a2-"))], (
        "the fleets are taken away: the control plane is shared with the suite"
    )
    for run in runs:
        f = arm_figures(run.arm, workload, run.records, fleet_model(workload.nodes), run.end)
        assert f.placed == len(workload.jobs)
        assert SUMMARY.fullmatch(f.summary_line()), f.summary_line()
