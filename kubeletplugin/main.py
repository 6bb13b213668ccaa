"""`carve-kubelet-plugin`: the node agent's entry point (composition root).

Every flag has an environment-variable equivalent (shown in --help) so a DaemonSet can be
configured either way; flags win over the environment. Start-up order matters:

1. load the checkpoint and reconcile it with NVML (finish or roll back interrupted work, record
   foreign instances) before the kubelet can send a single request;
2. serve the DRA socket, then the registration socket (PluginServer does both in that order);
3. publish ResourceSlices and keep them published.

SIGTERM/SIGINT stop intake first (sockets), then the publisher (deleting the slices only with
--cleanup-on-exit), then the worker pool, so no prepare is cut off half-way by our own shutdown.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.naming import DEFAULT_DRIVER_NAME
from process.logformat import configure_logging

log = logging.getLogger("carve.kubeletplugin")

_RETRY_PENDING_SECONDS = 30.0


@dataclass(frozen=True)
class _Flag:
    name: str
    env: str
    default: str | None
    help: str


_FLAGS = (
    _Flag("node-name", "NODE_NAME", None, "name of this node (required)"),
    _Flag("driver-name", "CARVE_DRIVER_NAME", DEFAULT_DRIVER_NAME, "DRA driver name"),
    _Flag("kubeconfig", "KUBECONFIG", None, "kubeconfig file; in-cluster config when unset"),
    _Flag(
        "registry-dir",
        "CARVE_REGISTRY_DIR",
        "/var/lib/kubelet/plugins_registry",
        "kubelet plugin registration directory",
    ),
    _Flag("plugins-dir", "CARVE_PLUGINS_DIR", "/var/lib/kubelet/plugins", "kubelet plugins dir"),
    _Flag("cdi-root", "CDI_ROOT", "/var/run/cdi", "directory for the per-claim CDI specs"),
    _Flag(
        "checkpoint-dir",
        "CARVE_CHECKPOINT_DIR",
        None,
        "checkpoint directory (default: <plugins-dir>/<driver-name>)",
    ),
    _Flag(
        "foreign-instances",
        "CARVE_FOREIGN_INSTANCES",
        "leave",
        "policy for MIG instances carve did not create: adopt | leave | refuse-gpu",
    ),
    _Flag(
        "simulate",
        "CARVE_SIMULATE",
        None,
        "NVML simulator config file: use driver.nvml.sim instead of the real NVML",
    ),
    _Flag("metrics-address", "CARVE_METRICS_ADDRESS", ":8080", "host:port for ops HTTP"),
    _Flag(
        "resync-seconds",
        "CARVE_RESYNC_SECONDS",
        "30",
        "ResourceSlice resync period (slices are republished if the kubelet wipes them)",
    ),
    _Flag("log-format", "CARVE_LOG_FORMAT", "json", "json | text"),
    _Flag("log-level", "CARVE_LOG_LEVEL", "info", "debug | info | warning | error"),
)
_BOOL_FLAGS = (
    _Flag("cleanup", "CARVE_CLEANUP", "false", "delete this node's ResourceSlices and exit"),
    _Flag(
        "cleanup-on-exit",
        "CARVE_CLEANUP_ON_EXIT",
        "false",
        "delete this node's ResourceSlices on SIGTERM (uninstall)",
    ),
    _Flag(
        "no-publish",
        "CARVE_NO_PUBLISH",
        "false",
        "do not publish ResourceSlices (another component does)",
    ),
)


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def build_parser(env: os._Environ[str] | dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="carve-kubelet-plugin",
        description="carve node agent: carves MIG slices when the kubelet prepares claims",
    )
    for f in _FLAGS:
        p.add_argument(
            f"--{f.name}",
            default=env.get(f.env, f.default),
            help=f"{f.help} [env {f.env}]" + (f" (default {f.default})" if f.default else ""),
        )
    for f in _BOOL_FLAGS:
        p.add_argument(
            f"--{f.name}",
            action="store_true",
            default=_truthy(env.get(f.env, f.default or "false")),
            help=f"{f.help} [env {f.env}]",
        )
    return p


@dataclass(frozen=True)
class Options:
    node_name: str
    driver_name: str
    kubeconfig: str | None
    registry_dir: Path
    plugins_dir: Path
    cdi_root: Path
    checkpoint_dir: Path
    foreign_instances: str
    simulate: Path | None
    metrics_address: str
    resync_seconds: float
    log_format: str
    log_level: str
    cleanup: bool
    cleanup_on_exit: bool
    no_publish: bool


class UsageError(ValueError):
    pass


def parse_options(argv: Sequence[str], env: dict[str, str] | None = None) -> Options:
    from kubeletplugin.prepare import ForeignPolicy

    ns = build_parser(env).parse_args(list(argv))
    if not ns.node_name:
        raise UsageError("--node-name (or NODE_NAME) is required")
    policies = [p.value for p in ForeignPolicy]
    if ns.foreign_instances not in policies:
        raise UsageError(
            f"--foreign-instances {ns.foreign_instances!r}: must be one of {', '.join(policies)}"
        )
    try:
        resync = float(ns.resync_seconds)
    except ValueError:
        raise UsageError(f"--resync-seconds {ns.resync_seconds!r} is not a number") from None
    if ns.log_format not in ("json", "text"):
        raise UsageError("--log-format must be json or text")
    plugins_dir = Path(ns.plugins_dir)
    return Options(
        node_name=ns.node_name,
        driver_name=ns.driver_name,
        kubeconfig=ns.kubeconfig or None,
        registry_dir=Path(ns.registry_dir),
        plugins_dir=plugins_dir,
        cdi_root=Path(ns.cdi_root),
        checkpoint_dir=Path(ns.checkpoint_dir or plugins_dir / ns.driver_name),
        foreign_instances=ns.foreign_instances,
        simulate=Path(ns.simulate) if ns.simulate else None,
        metrics_address=ns.metrics_address,
        resync_seconds=resync,
        log_format=ns.log_format,
        log_level=ns.log_level,
        cleanup=ns.cleanup,
        cleanup_on_exit=ns.cleanup_on_exit,
        no_publish=ns.no_publish,
    )


def _api_client(opts: Options) -> Any:
    from kubernetes import client, config

    loader: Any = config
    cfg = client.Configuration()
    if opts.kubeconfig:
        loader.load_kube_config(config_file=opts.kubeconfig, client_configuration=cfg)
    else:
        loader.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)


def run(opts: Options, stop: threading.Event) -> int:
    from driver.cdi import CdiWriter
    from kubeletplugin.checkpoint import CheckpointStore, ClaimState
    from kubeletplugin.claims import KubeJson, KubernetesClaimClient
    from kubeletplugin.metrics import PluginMetrics
    from kubeletplugin.migbackend import open_backend
    from kubeletplugin.prepare import ForeignPolicy, Preparer, PreparerSettings
    from kubeletplugin.publisher import PublisherSettings, SlicePublisher
    from kubeletplugin.server import PluginServer
    from process.opshttp import OpsServer

    api = KubeJson(_api_client(opts))
    metrics = PluginMetrics()
    pub_settings = PublisherSettings(
        opts.driver_name, opts.node_name, resync_seconds=opts.resync_seconds
    )
    if opts.cleanup:
        removed = SlicePublisher(pub_settings, api, lambda g, s: [], metrics).cleanup()
        print(f"removed {removed} ResourceSlice(s) of {opts.driver_name} on {opts.node_name}")
        return 0

    node = open_backend(opts.simulate)
    preparer = Preparer(
        settings=PreparerSettings(
            driver_name=opts.driver_name,
            node_name=opts.node_name,
            pool_name=opts.node_name,
            foreign_policy=ForeignPolicy(opts.foreign_instances),
        ),
        backend=node.mig,
        claims=KubernetesClaimClient(api),
        store=CheckpointStore(opts.checkpoint_dir),
        cdi=CdiWriter(opts.cdi_root, vendor=opts.driver_name),
        metrics=metrics,
        common_nodes=node.common_device_nodes(),
    )
    preparer.reconcile()
    # Before serving: release instances of checkpointed claims that are gone from the API (the
    # node came back to a different or rebuilt cluster, or finalizers were stripped by hand).
    # Otherwise their placements stay taken, and every prepare allocated there fails until the
    # first periodic housekeeping pass. An unreachable API leaves everything as it is.
    preparer.retry_pending()
    publisher = SlicePublisher(
        pub_settings,
        api,
        lambda generation, split: node.resource_slices(
            driver=opts.driver_name,
            node_name=opts.node_name,
            generation=generation,
            split=split,
            exclude=set(preparer.refused_gpus()),
        ),
        metrics,
    )
    server = PluginServer(
        opts.driver_name,
        opts.registry_dir,
        opts.plugins_dir,
        preparer,
        node.health_source(opts.driver_name, opts.node_name, preparer.refused_gpus),
    )

    def api_check() -> str:
        try:
            api.request("GET", "/version")
            return ""
        except Exception as e:
            return f"apiserver unreachable: {e}"

    def registration_check() -> str:
        st = server.registration
        if st.registered:
            return ""
        return st.error or "kubelet has not registered the plugin yet"

    def slices_check() -> str:
        if opts.no_publish or publisher.synced_once.is_set():
            return ""
        return publisher.last_error or "ResourceSlices not published yet"

    def pending_check() -> str:
        n = sum(
            1
            for r in preparer.checkpoint().claims.values()
            if r.state is not ClaimState.PREPARE_COMPLETED
        )
        return f"{n} interrupted claim operation(s) pending" if n else ""

    ops = OpsServer(
        opts.metrics_address,
        metrics.registry,
        {
            "registration": registration_check,
            "apiserver": api_check,
            "resourceslices": slices_check,
            "checkpoint": pending_check,
        },
    )
    ops.start()
    server.start()
    if not opts.no_publish:
        publisher.start()
    log.info(
        "carve kubelet plugin running",
        extra={
            "node": opts.node_name,
            "driver": opts.driver_name,
            "simulated": opts.simulate is not None,
            "opsPort": ops.port,
        },
    )
    last_verdict = server.registration
    next_retry = time.monotonic() + _RETRY_PENDING_SECONDS
    while not stop.wait(0.5):
        # Every registration (each verdict is a new object) may follow a kubelet restart, and
        # the kubelet wipes the node's slices when it starts: republish at once.
        verdict = server.registration
        if verdict is not last_verdict and verdict.registered:
            publisher.trigger()
        last_verdict = verdict
        if time.monotonic() >= next_retry:
            preparer.retry_pending()
            next_retry = time.monotonic() + _RETRY_PENDING_SECONDS
    log.info("shutting down")
    server.stop(grace=10.0)
    if not opts.no_publish:
        publisher.stop()
        if opts.cleanup_on_exit:
            try:
                publisher.cleanup()
            except Exception:
                log.exception("could not remove ResourceSlices on exit")
    preparer.close()
    node.close()
    ops.stop()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"carve-kubelet-plugin: {e}", file=sys.stderr)
        return 2
    configure_logging(opts.log_format, opts.log_level)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from kubeletplugin.checkpoint import CheckpointVersionError

    try:
        return run(opts, stop)
    except CheckpointVersionError as e:
        # Not "fatal error" with a traceback: the operator needs the one message that says
        # which file, which version, and what to do (see kubeletplugin.checkpoint).
        log.error(str(e), extra={"checkpoint": str(e.path), "versionFound": e.found})
        return 1
    except Exception:
        log.exception("fatal error")
        return 1


if __name__ == "__main__":
    sys.exit(main())
