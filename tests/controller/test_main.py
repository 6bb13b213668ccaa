"""carve-controller's entry point: its flags, their environment twins, usage errors, ops HTTP."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controller.main import Controller, parse_options, serve_http
from controller.metrics import ControllerMetrics
from controller.placement import DEFAULT_POLICY, Policy
from process.flags import UsageError

REPO = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    o = parse_options([], {})
    assert (o.driver_name, o.device_classes, o.native_fallback_after) == (
        "mig.carve.dev",
        None,
        None,
    )
    assert (o.resync_period, o.retry_interval, o.http_address) == (600.0, 30.0, ":8080")
    assert (o.log_format, o.log_level, o.kubeconfig) == ("json", "INFO", None)
    assert o.lease is not None and o.lease.namespace == "carve-system"
    assert (o.lease.lease_duration_s, o.lease.renew_deadline_s, o.lease.retry_period_s) == (
        15.0,
        10.0,
        2.0,
    )


def test_the_gate_is_held_until_carved_by_default() -> None:
    o = parse_options([], {})
    assert (o.hold_gate_until_carved, o.carve_wait) == (True, 30.0)
    off = parse_options(["--hold-gate-until-carved=false", "--carve-wait=5s"], {})
    assert (off.hold_gate_until_carved, off.carve_wait) == (False, 5.0)


def test_placements_are_written_by_eight_workers_unless_told_otherwise() -> None:
    assert parse_options([], {}).commit_workers == 8
    assert parse_options(["--commit-workers=0"], {}).commit_workers == 0
    assert parse_options([], {"CARVE_COMMIT_WORKERS": "3"}).commit_workers == 3


@pytest.mark.parametrize("policy", list(Policy))
def test_the_packing_policy_flag_selects_any_policy_the_engine_offers(policy: Policy) -> None:
    from kubernetes.client import ApiClient

    from controller.planner import EnginePlanner

    for opts in (
        parse_options([f"--packing-policy={policy.value}"], {}),
        parse_options([], {"CARVE_PACKING_POLICY": policy.value}),
    ):
        assert opts.packing_policy is policy
        quiet = dataclasses.replace(opts, lease=None, http_address="")
        planner = Controller(ApiClient(), quiet).planner
        assert isinstance(planner, EnginePlanner)
        assert planner.engine.policy is policy


def test_the_packing_policy_defaults_to_the_engines_default() -> None:
    assert parse_options([], {}).packing_policy is DEFAULT_POLICY


def test_flags_have_environment_equivalents() -> None:
    env = {
        "CARVE_NATIVE_FALLBACK_AFTER": "10m",
        "CARVE_DRIVER_NAME": "mig.example.org",
        "CARVE_DEVICE_CLASSES": "a.example.org, b.example.org",
        "CARVE_LEADER_ELECT": "false",
        "CARVE_HTTP_ADDRESS": "",
        "KUBECONFIG": "/k",
        "POD_NAME": "carve-0",
    }
    o = parse_options([], env)
    assert (o.native_fallback_after, o.driver_name) == (600.0, "mig.example.org")
    assert o.device_classes == frozenset({"a.example.org", "b.example.org"})
    assert o.lease is None and o.identity == "carve-0"
    assert (o.http_address, o.kubeconfig) == ("", "/k")
    flagged = parse_options(["--driver-name", "x.example.org", "--kubeconfig=/c"], env)
    assert (flagged.driver_name, flagged.kubeconfig) == ("x.example.org", "/c")
    assert parse_options([], {**env, "CARVE_KUBECONFIG": "/ck"}).kubeconfig == "/ck"


def test_leader_elect_takes_a_value_or_stands_alone() -> None:
    assert parse_options(["--leader-elect=false"], {}).lease is None
    assert parse_options(["--leader-elect"], {"CARVE_LEADER_ELECT": "false"}).lease is not None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--resync-period=abc"],
            r"--resync-period='abc': not a duration.*e\.g\. --resync-period=",
        ),
        (["--lease-duration", "soon"], "--lease-duration='soon'"),
        (["--native-fallback-after=5 minutes"], "e.g. --native-fallback-after=10m"),
        (["--leader-elect=maybe"], "not a boolean"),
        (["--renew-deadline=20s"], "retry period < renew deadline < lease duration"),
        (["--driver-name=Not_DNS"], "not a DNS subdomain"),
        (["--log-level=loud"], "not a log level"),
        (["--hold-gate-until-carved=perhaps"], "not a boolean"),
        (["--carve-wait=later"], r"--carve-wait='later': not a duration.*e\.g\. --carve-wait=30s"),
        (["--commit-workers=many"], r"--commit-workers='many': must be a whole number from 0"),
        (["--commit-workers=100"], r"to 64.*e\.g\. --commit-workers=8"),
        (
            ["--packing-policy=tightest"],
            r"must be one of best-fit, least-waste, fill-holes, first-fit",
        ),
    ],
)
def test_bad_values_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_options(argv, {})


def test_a_bad_value_exits_2_naming_the_flag_and_an_example() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controller.main", "--resync-period=abc"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("carve-controller: --resync-period='abc': not a duration")
    assert out.stderr.rstrip().endswith("; e.g. --resync-period=10m")


def test_http_endpoints() -> None:
    unsynced = ["ResourceSlice", "DeviceTaintRule"]
    m = ControllerMetrics()
    m.set_queue_depth(2)
    server = serve_http("127.0.0.1:0", m, lambda: unsynced)
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/healthz") as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/readyz?verbose")
        assert err.value.code == 503
        # Which kinds are still being listed: one that never syncs points at RBAC or the API.
        assert (
            "informers not synced yet: ResourceSlice, DeviceTaintRule" in err.value.read().decode()
        )
        unsynced.clear()
        with urllib.request.urlopen(f"{base}/readyz") as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{base}/metrics") as r:
            assert b"carve_pending_pods 2.0" in r.read()
    finally:
        server.stop()


def test_preemption_is_on_by_default_and_can_be_turned_off() -> None:
    on = parse_options([], env={})
    assert on.preemption is True
    assert on.preemption_hold == 300.0
    off = parse_options(["--preemption=false", "--preemption-hold=90s"], env={})
    assert off.preemption is False
    assert off.preemption_hold == 90.0
    assert parse_options([], env={"CARVE_PREEMPTION": "false"}).preemption is False
