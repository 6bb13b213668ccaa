"""`carve-controller`: the central allocator process.

Every flag has an environment equivalent (`CARVE_<FLAG>` with dashes as underscores), so the
Deployment can be configured either way; flags win over the environment.

Process shape: five informer threads feed one reconciler thread; a leader-election thread gates
the reconciler (followers keep their caches warm, so a failover decides on a full picture at once
but still only after its informers have listed); an HTTP thread serves /metrics, /healthz and
/readyz. Losing the lease ends the process (exit code 3): a restart is the simplest way to be sure
that no decision of the old term survives into the next.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from controller.events import KubeRecorder
from controller.informers import Informer, InformerConfig, standard_informers, start_informers
from controller.leader import LeaderElector, LeaseConfig
from controller.metrics import ControllerMetrics
from controller.reconciler import CarveClasses, Planner, Reconciler, ReconcilerConfig
from controller.status import KubeClaimWriter
from driver.contract import Contract
from driver.naming import DEFAULT_DRIVER_NAME
from process.logformat import configure_logging
from process.opshttp import OpsServer

_log = logging.getLogger("carve.controller")

EXIT_LOST_LEASE = 3

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1.5h', '250ms' -> seconds. Rejects anything else with a clear message."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h)")
    scale = {"ms": 0.001, "s": 1.0, None: 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
    return float(m.group(1)) * scale


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("CARVE_" + name.upper().replace("-", "_"), default)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="carve-controller",
        description="Central MIG allocator for carve (a DRA driver for NVIDIA MIG).",
    )

    def opt(flag: str, help_: str, default: str | None, **kw: Any) -> None:
        env = "CARVE_" + flag.upper().replace("-", "_")
        p.add_argument(f"--{flag}", default=_env(flag, default), help=f"{help_} [env {env}]", **kw)

    opt("kubeconfig", "kubeconfig file; in-cluster config when unset", os.environ.get("KUBECONFIG"))
    opt(
        "driver-name",
        "DRA driver name; every finalizer, gate and class derives from it",
        DEFAULT_DRIVER_NAME,
    )
    opt(
        "device-classes",
        "comma-separated DeviceClass names that are carve's, besides every '*.<driver>' class "
        "(default: <driver> and its whole-GPU class, e.g. mig.carve.dev,gpu.carve.dev)",
        None,
    )
    opt(
        "native-fallback-after",
        "ungate pods unplaceable for this long so kube-scheduler handles them (off when unset)",
        None,
    )
    opt("leader-elect", "run leader election (true/false)", "true")
    opt("lease-name", "Lease object name", "carve-controller")
    opt("lease-namespace", "Lease namespace", os.environ.get("POD_NAMESPACE", "carve-system"))
    opt("identity", "leader-election identity", os.environ.get("POD_NAME", socket.gethostname()))
    opt("lease-duration", "lease duration", "15s")
    opt("renew-deadline", "renew deadline", "10s")
    opt("retry-period", "leader-election retry period", "2s")
    opt("resync-period", "full relist and re-examination period", "10m")
    opt("retry-interval", "how often a waiting pod is retried without any change", "30s")
    opt("http-address", "address for /metrics, /healthz, /readyz ('' disables)", ":8080")
    opt("log-format", "json or text", "json")
    opt("log-level", "DEBUG, INFO, WARNING, ERROR", "INFO")
    return p


# -- HTTP --------------------------------------------------------------------------------------


def serve_http(address: str, metrics: ControllerMetrics, ready: Callable[[], bool]) -> OpsServer:
    """Start the ops endpoints; /readyz names the one thing that gates the controller."""
    server = OpsServer(
        address,
        metrics.registry,
        {"informers": lambda: "" if ready() else "informers not synced"},
    )
    server.start()
    return server


# -- wiring ------------------------------------------------------------------------------------


def default_planner(driver: str) -> Planner:
    """The placement engine behind the reconciler's `Planner` seam."""
    from controller.planner import EnginePlanner

    return EnginePlanner(driver)


class Controller:
    """The assembled process; `run` blocks until `stop` (or the lease is lost)."""

    def __init__(
        self,
        api_client: Any,
        args: argparse.Namespace,
        planner: Planner | None = None,
    ) -> None:
        from kubernetes import client

        self.args = args
        core = client.CoreV1Api(api_client)
        resource = client.ResourceV1Api(api_client)
        self.metrics = ControllerMetrics()
        self.stop_event = threading.Event()
        self.exit_code = 0
        contract = Contract(args.driver_name)
        names = (
            frozenset(n.strip() for n in args.device_classes.split(",") if n.strip())
            if args.device_classes
            else None
        )
        self.config = ReconcilerConfig(
            contract=contract,
            classes=CarveClasses.of(contract, names),
            native_fallback_after=(
                parse_duration(args.native_fallback_after) if args.native_fallback_after else None
            ),
            retry_interval=parse_duration(args.retry_interval),
        )
        self.elector: LeaderElector | None = None
        if _bool(args.leader_elect):
            self.elector = LeaderElector(
                client.CoordinationV1Api(api_client),
                LeaseConfig(
                    name=args.lease_name,
                    namespace=args.lease_namespace,
                    identity=args.identity,
                    lease_duration_s=parse_duration(args.lease_duration),
                    renew_deadline_s=parse_duration(args.renew_deadline),
                    retry_period_s=parse_duration(args.retry_period),
                ),
            )
        fence = self.elector.is_leader if self.elector else (lambda: True)
        self.writer = KubeClaimWriter(resource, core, contract=contract, fence=fence)
        self.recorder = KubeRecorder(
            client.EventsV1Api(api_client),
            controller=contract.event_source,
            instance=args.identity,
        )
        self.reconciler = Reconciler(
            planner or default_planner(args.driver_name),
            self.writer,
            self.recorder,
            config=self.config,
            metrics=self.metrics,
            is_leader=fence,
        )
        self.resync_s = parse_duration(args.resync_period)
        self.informers: list[Informer] = standard_informers(
            core,
            resource,
            self.reconciler.enqueue,
            self.reconciler.mark_synced,
            InformerConfig(resync_period_s=self.resync_s),
        )
        self._http: OpsServer | None = None

    def ready(self) -> bool:
        return all(i.has_synced for i in self.informers)

    def _on_lost(self) -> None:
        self.exit_code = EXIT_LOST_LEASE
        self.metrics.leader.set(0)
        self.stop_event.set()

    def run(self) -> int:
        if self.args.http_address:
            self._http = serve_http(self.args.http_address, self.metrics, self.ready)
        start_informers(self.informers, time.monotonic)
        if self.elector is not None:
            elector = self.elector
            threading.Thread(
                target=elector.run,
                args=(lambda: self.metrics.leader.set(1), self._on_lost),
                name="leader-election",
                daemon=True,
            ).start()
        else:
            self.metrics.leader.set(1)
        next_resync = time.monotonic() + self.resync_s
        next_usage = 0.0
        while not self.stop_event.is_set():
            try:
                self.reconciler.step(timeout=0.5)
                now = time.monotonic()
                if now >= next_resync:
                    self.reconciler.resync()
                    next_resync = now + self.resync_s
                if now >= next_usage and self.reconciler.synced:
                    self.metrics.update_usage(self.reconciler.stores, self.config.driver)
                    next_usage = now + 15.0
            except Exception:
                _log.exception("reconcile step failed; continuing")
                self.stop_event.wait(1.0)
        self.shutdown()
        return self.exit_code

    def shutdown(self) -> None:
        for inf in self.informers:
            inf.stop()
        if self.elector is not None:
            self.elector.stop(release=self.exit_code != EXIT_LOST_LEASE)
        if self._http is not None:
            self._http.stop()

    def stop(self) -> None:
        self.stop_event.set()


def load_api_client(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    config.load_incluster_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        for flag in ("lease_duration", "renew_deadline", "retry_period", "resync_period"):
            parse_duration(getattr(args, flag))
        if args.native_fallback_after:
            parse_duration(args.native_fallback_after)
        controller = Controller(load_api_client(args.kubeconfig), args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        print(f"carve-controller: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: controller.stop())
    signal.signal(signal.SIGINT, lambda *_: controller.stop())
    _log.info("carve-controller starting as %s", args.identity)
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
