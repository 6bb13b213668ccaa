"""The arms of ``python -m bench.cluster_packing`` (who places an arm's pods, with which
kube-scheduler profile) and the kube-scheduler process each arm gets.

Every arm, carve's too, has a kube-scheduler process of its own (the cluster's binary, started
from a KubeSchedulerConfiguration holding just the arm's one profile, no leader election):

- a scheduler arm's places its pods, so one arm's queue of unschedulable pods never delays
  another arm;
- carve's binds what carve-controller placed (its default profile, named ``bench-carve``). It
  does not use the cluster's own kube-scheduler, which runs with leader election: on this
  shared machine a load spike made it miss a Lease renewal, lose the lease and exit, and the
  carve arm stopped binding for the rest of the run while the scheduler arms went on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.placement import DEFAULT_POLICY, Policy

ARM_LABEL = "bench.carve.dev/arm"
DEFAULT_PROFILE: Mapping[str, Any] = {"schedulerName": "bench-default"}
"""kube-scheduler's default profile, untouched but for its name: what a user gets by default."""
BINPACK_PROFILE: Mapping[str, Any] = {
    "schedulerName": "bench-binpack",
    # Bin packing as the Kubernetes documentation configures it ("Resource Bin Packing"):
    # NodeResourcesFit scores with MostAllocated. Its DRA-aware part (DRAExtendedResource)
    # counts only extended resources a pod requests in resources.requests, and the
    # DynamicResources plugin scores only firstAvailable preferences, so for pods that ask
    # through ResourceClaims cpu and memory are what v1.37 can score.
    "pluginConfig": [
        {
            "name": "NodeResourcesFit",
            "args": {
                "scoringStrategy": {
                    "type": "MostAllocated",
                    "resources": [
                        {"name": "cpu", "weight": 1},
                        {"name": "memory", "weight": 1},
                    ],
                }
            },
        }
    ],
}
CARVE_PROFILE: Mapping[str, Any] = {"schedulerName": "bench-carve"}
"""The carve arm's kube-scheduler: the default profile, renamed; it only binds (carve-controller
has allocated the claims, which fixes the node)."""
SCHEDULER_PROFILES: Mapping[str, Mapping[str, Any]] = {
    "scheduler-default": DEFAULT_PROFILE,
    "scheduler-binpack": BINPACK_PROFILE,
}
"""Scheduler arm -> the one profile of its kube-scheduler's KubeSchedulerConfiguration."""


@dataclass(frozen=True)
class Arm:
    """One way of placing the jobs: carve's controller with a policy (its kube-scheduler only
    binds), or a kube-scheduler with a profile on the native path."""

    name: str
    policy: Policy | None  # carve arms
    profile: Mapping[str, Any]  # the one profile of the arm's kube-scheduler

    @property
    def carve(self) -> bool:
        return self.policy is not None

    @property
    def scheduler(self) -> str:
        """The pods' schedulerName."""
        return str(self.profile["schedulerName"])


def parse_arm(name: str) -> Arm:
    """``carve`` (the controller's default policy), ``carve-<policy>``, ``scheduler-default``
    or ``scheduler-binpack``."""
    if name == "carve":
        return Arm(f"carve-{DEFAULT_POLICY.value}", DEFAULT_POLICY, CARVE_PROFILE)
    if name.startswith("carve-"):
        try:
            return Arm(name, Policy(name.removeprefix("carve-")), CARVE_PROFILE)
        except ValueError:
            pass
    if name in SCHEDULER_PROFILES:
        return Arm(name, None, SCHEDULER_PROFILES[name])
    choices = ", ".join(["carve", *(f"carve-{p.value}" for p in Policy), *SCHEDULER_PROFILES])
    raise ValueError(f"unknown arm {name!r}; one of {choices}")


def parse_arms(text: str) -> list[Arm]:
    """Comma-separated arm names; at most one carve arm (one controller runs at a time)."""
    arms = [parse_arm(a.strip()) for a in text.split(",") if a.strip()]
    if not arms:
        raise ValueError("no arms")
    if sum(a.carve for a in arms) > 1:
        raise ValueError("at most one carve arm per run: one carve-controller places them all")
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("an arm is named twice")
    return arms


# ---------------------------------------------------------------------------------------------
# kube-scheduler


def scheduler_metrics(root: Path, port: int) -> str:
    """A kube-scheduler's /metrics, read with the cluster admin's certificate."""
    import ssl
    import urllib.request

    from devcluster.components import Layout

    pki = Layout(root).pki_dir
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.check_hostname = False  # the serving certificate is kube-scheduler's own, self-signed
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    url = f"https://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, context=ctx, timeout=30) as resp:
        return str(resp.read().decode())


@dataclass(frozen=True)
class SchedulerWork:
    """What one kube-scheduler did: attempts of one profile by result, and its CPU seconds."""

    scheduled: float
    unschedulable: float
    cpu_s: float

    @classmethod
    def read(cls, root: Path, port: int, profile: str) -> SchedulerWork:
        from tests.support import promtext

        try:
            text = scheduler_metrics(root, port)
        except OSError:
            return cls(math.nan, math.nan, math.nan)
        attempts = "scheduler_schedule_attempts_total"
        return cls(
            promtext.counter_sum(text, attempts, result="scheduled", profile=profile),
            promtext.counter_sum(text, attempts, result="unschedulable", profile=profile),
            promtext.counter_sum(text, "process_cpu_seconds_total"),
        )

    def since(self, before: SchedulerWork) -> str:
        return (
            f"kube-scheduler: {self.scheduled - before.scheduled:.0f} pods scheduled, "
            f"{self.unschedulable - before.unschedulable:.0f} attempts unschedulable, "
            f"{self.cpu_s - before.cpu_s:.0f} CPU seconds"
        )


class ArmScheduler:
    """A kube-scheduler process for one arm: the cluster's binary and credentials, a
    KubeSchedulerConfiguration with the arm's one profile, no leader election (module
    docstring)."""

    def __init__(self, info: Any, arm: Arm, workdir: Path, client_qps: float | None) -> None:
        from devcluster import components
        from devcluster.binaries import ensure_binaries
        from devcluster.components import Layout, Ports
        from devcluster.processes import ManagedProcess
        from tests.support.scale_processes import free_port

        self.root = Path(info.root)
        self.profile = arm.scheduler
        layout = Layout(self.root)
        config = workdir / f"kube-scheduler-{arm.name}.yaml"
        config.write_text(
            json.dumps(
                components.scheduler_config(
                    layout, [arm.profile], client_qps=client_qps, leader_elect=False
                ),
                indent=1,
            )
        )
        self.port = free_port()
        ports = dataclasses.replace(Ports(**dataclasses.asdict(info.ports)), scheduler=self.port)
        argv = components.scheduler_args(
            ensure_binaries(build=False).kube_scheduler, layout, ports, config=config
        )
        self.process = ManagedProcess(
            f"kube-scheduler-{arm.name}",
            argv,
            workdir / f"kube-scheduler-{arm.name}.log",
            tie_to_parent=True,
        )
        deadline = time.monotonic() + 120
        while math.isnan(self.work().scheduled):
            if self.process.exit_code() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kube-scheduler for {arm.name}:\n{self.process.log_tail(30)}")
            time.sleep(0.5)

    def work(self) -> SchedulerWork:
        return SchedulerWork.read(self.root, self.port, self.profile)

    def stop(self) -> None:
        self.process.stop()
