"""`carve-kubelet-plugin`'s flags and the options they make.

Flags come from `process.flags`: every one has its environment twin `CARVE_<FLAG>` (shown in
--help) so a DaemonSet can be configured either way; flags win over the environment. The old
spellings `--metrics-address` and `--resync-seconds` (and their variables, and `CDI_ROOT`) still
work and log a deprecation warning; a bad value exits 2 with the flag and an example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from driver.gpuhealth import (
    HealthConfigError,
    HealthPolicy,
    TaintEffect,
    parse_effect,
    parse_xids,
)
from kubeletplugin.warm import WarmSettings
from process import flags
from process.flags import Flag

PROG = "carve-kubelet-plugin"
ROOT = Path("/")  # a driver root or dev root of /: the host's own

# -- flags -------------------------------------------------------------------------------------


def _foreign_policy(text: str) -> str:
    from kubeletplugin.foreign import ForeignPolicy

    return flags.one_of(*(p.value for p in ForeignPolicy))(text)


NODE_NAME: Flag[str] = Flag(
    "node-name",
    "name of this node (required)",
    "",
    flags.required,
    example="gpu-node-1",
    also_env=("NODE_NAME",),
)
REGISTRY_DIR: Flag[Path] = Flag(
    "registry-dir",
    "kubelet plugin registration directory",
    "/var/lib/kubelet/plugins_registry",
    flags.path,
    example="/var/lib/kubelet/plugins_registry",
)
PLUGINS_DIR: Flag[Path] = Flag(
    "plugins-dir",
    "kubelet plugins directory",
    "/var/lib/kubelet/plugins",
    flags.path,
    example="/var/lib/kubelet/plugins",
)
CDI_ROOT: Flag[Path] = Flag(
    "cdi-root",
    "directory for the per-claim CDI specs",
    "/var/run/cdi",
    flags.path,
    example="/var/run/cdi",
    deprecated_env=("CDI_ROOT",),
)
CHECKPOINT_DIR: Flag[Path | None] = Flag(
    "checkpoint-dir",
    "checkpoint directory (default: <plugins-dir>/<driver-name>)",
    "",
    flags.optional_path,
    example="/var/lib/kubelet/plugins/mig.carve.dev",
)
FOREIGN_INSTANCES: Flag[str] = Flag(
    "foreign-instances",
    "policy for MIG instances carve did not create: adopt | leave | refuse-gpu",
    "leave",
    _foreign_policy,
    example="leave",
)
WARM_SLICES_TTL = flags.duration(
    "warm-slices-ttl",
    "keep a released claim's MIG instance carved this long for the next claim of the same "
    "profile and placement (warm slices, docs/kubeletplugin.md); 0s: destroy at once",
    "0s",
)
WARM_SLICES_ACROSS_NAMESPACES = flags.switch(
    "warm-slices-across-namespaces",
    "let a claim reuse a warm MIG instance another namespace's claim released (MIG leaves the "
    "previous user's data in the slice's memory; carve clears nothing)",
)
NVML_TIMEOUT = flags.duration(
    "nvml-timeout",
    "deadline of one NVML operation on a GPU (a carve, a destroy, a MIG-mode change); a GPU "
    "whose call overruns it is unresponsive until the call returns: tainted, reported, and "
    "left alone while the other GPUs go on (0s: no deadline)",
    "20s",
)
SIMULATE: Flag[Path | None] = Flag(
    "simulate",
    "NVML simulator config file: use driver.nvml.sim instead of the real NVML",
    "",
    flags.optional_path,
    example="sim.yaml",
)
DRIVER_ROOT: Flag[Path] = Flag(
    "driver-root",
    "where the NVIDIA driver's user-space files are (containers get them through the CDI specs): "
    "/ for a driver installed on the host, /run/nvidia/driver with the GPU Operator; with "
    "--simulate, a directory the simulator fills with a fake driver (/: none)",
    "/",
    flags.path,
    example="/run/nvidia/driver",
)
DEV_ROOT: Flag[Path] = Flag(
    "dev-root",
    "where the NVIDIA device nodes are on the host, as a root (<dev-root>/dev/nvidia0); not /: "
    "the CDI device nodes name it as hostPath; with --simulate, a directory the simulator "
    "creates the nodes in (/: none)",
    "/",
    flags.path,
    example="/run/nvidia/driver",
)

MPS_DAEMON_IMAGE: Flag[str | None] = Flag(
    "mps-daemon-image",
    "run each claim's MPS control daemon in a pod of its own with this image (carve's), on "
    "this node in --mps-daemon-namespace, so that it outlives the plugin's pod; empty: as a "
    "child process of the plugin, which outlives the plugin only when it runs on the host",
    "",
    flags.optional_text,
    example="ghcr.io/carve-dev/carve:0.2.0",
)
MPS_DAEMON_NAMESPACE: Flag[str | None] = Flag(
    "mps-daemon-namespace",
    "with --mps-daemon-image: the namespace of the MPS daemon pods (the plugin's own)",
    "",
    flags.optional_text,
    example="carve-system",
)
MPS_DAEMON_SERVICE_ACCOUNT: Flag[str | None] = Flag(
    "mps-daemon-service-account",
    "with --mps-daemon-image: the service account of the MPS daemon pods, one with no API "
    "rights (the chart's carve-mps-daemon, which its admission policy requires); empty: the "
    "namespace's default. No token is mounted either way",
    "",
    flags.optional_text,
    example="carve-mps-daemon",
)
MPS_DAEMON_IMAGE_PULL_POLICY: Flag[str] = Flag(
    "mps-daemon-image-pull-policy",
    "with --mps-daemon-image: the pods' imagePullPolicy",
    "IfNotPresent",
    flags.one_of("IfNotPresent", "Always", "Never"),
    example="IfNotPresent",
)


def _xids(setting: str) -> Callable[[str], frozenset[int]]:
    return lambda text: parse_xids(text, setting)


def _effect(setting: str) -> Callable[[str], str]:
    return lambda text: parse_effect(text, setting).value


FATAL_XIDS: Flag[frozenset[int]] = Flag(
    "fatal-xids",
    "XIDs that make a GPU unhealthy until it is reset (comma-separated); other XIDs not in "
    "--ignored-xids degrade it",
    "48,62,64,74,79,95,119,120,140",
    _xids("--fatal-xids"),
    example="48,79",
)
IGNORED_XIDS: Flag[frozenset[int]] = Flag(
    "ignored-xids",
    "XIDs that applications cause and that leave the GPU healthy (comma-separated)",
    "13,31,43,45,68,109",
    _xids("--ignored-xids"),
    example="13,31,43,45,68,109",
)
FATAL_TAINT_EFFECT: Flag[str] = Flag(
    "fatal-taint-effect",
    "device taint effect for a GPU with a fatal error: NoExecute | NoSchedule | None",
    "NoExecute",
    _effect("--fatal-taint-effect"),
    example="NoExecute",
)
DEGRADED_TAINT_EFFECT: Flag[str] = Flag(
    "degraded-taint-effect",
    "device taint effect for a degraded GPU: NoSchedule | NoExecute | None",
    "NoSchedule",
    _effect("--degraded-taint-effect"),
    example="NoSchedule",
)
HEALTH_RECOVERY = flags.duration(
    "health-recovery",
    "a degraded GPU without a new error for this long is healthy again",
    "5m",
)
HEALTH_POLL = flags.duration(
    "health-poll-period",
    "how often GPU health is polled (recovery action, ECC counters); events arrive at once",
    "5s",
)
BINDING_CONDITIONS = flags.switch(
    "binding-conditions",
    "carve before bind: publish devices with binding conditions, carve as soon as a claim is "
    "allocated here and report it in the claim's status.devices; kube-scheduler binds the pod "
    "only after that, and a failed carve sends the claim elsewhere (kubeletplugin.precarve)",
)
CARVE_FAILURE_COOLDOWN = flags.duration(
    "carve-failure-cooldown",
    "with --binding-conditions: how long a GPU on which NVML refused to carve carries the "
    "device taint <driver>/carve-failed:NoSchedule (0 = never tainted)",
    "5m",
)
CONTROLLER_LEASE: Flag[str | None] = Flag(
    "controller-lease",
    "<namespace>/<name> of carve-controller's leader Lease, whose contract version this plugin "
    "checks: more than one away from its own, it refuses new prepares (docs/architecture.md, "
    "Version skew); empty: not checked",
    "",
    flags.optional_text,
    example="carve-system/carve-controller",
)
HTTP_ADDRESS = flags.http_address(deprecated=("metrics-address",))
RESYNC_PERIOD = flags.resync_period(
    "30s",
    "ResourceSlice resync period (slices are republished if the kubelet wipes them)",
    deprecated=("resync-seconds",),
)
CLEANUP = flags.switch("cleanup", "delete this node's ResourceSlices and exit")
CLEANUP_ON_EXIT = flags.switch(
    "cleanup-on-exit", "delete this node's ResourceSlices on SIGTERM (uninstall)"
)
NO_PUBLISH = flags.switch("no-publish", "do not publish ResourceSlices (another component does)")

COMMAND_LINE = flags.CommandLine(
    PROG,
    "carve node agent: carves MIG slices when the kubelet prepares claims",
    (
        NODE_NAME,
        flags.DRIVER_NAME,
        flags.KUBECONFIG,
        REGISTRY_DIR,
        PLUGINS_DIR,
        CDI_ROOT,
        CHECKPOINT_DIR,
        FOREIGN_INSTANCES,
        WARM_SLICES_TTL,
        WARM_SLICES_ACROSS_NAMESPACES,
        NVML_TIMEOUT,
        SIMULATE,
        DRIVER_ROOT,
        DEV_ROOT,
        MPS_DAEMON_IMAGE,
        MPS_DAEMON_NAMESPACE,
        MPS_DAEMON_SERVICE_ACCOUNT,
        MPS_DAEMON_IMAGE_PULL_POLICY,
        FATAL_XIDS,
        IGNORED_XIDS,
        FATAL_TAINT_EFFECT,
        DEGRADED_TAINT_EFFECT,
        HEALTH_RECOVERY,
        HEALTH_POLL,
        BINDING_CONDITIONS,
        CARVE_FAILURE_COOLDOWN,
        CONTROLLER_LEASE,
        HTTP_ADDRESS,
        RESYNC_PERIOD,
        *flags.LOGGING,
        CLEANUP,
        CLEANUP_ON_EXIT,
        NO_PUBLISH,
    ),
)


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
    http_address: str
    resync_period: float
    log_format: str
    log_level: str
    cleanup: bool
    cleanup_on_exit: bool
    no_publish: bool
    deprecations: tuple[str, ...] = ()
    driver_root: Path = ROOT
    dev_root: Path = ROOT
    health: HealthPolicy = field(default_factory=HealthPolicy)
    health_poll_period: float = 5.0
    binding_conditions: bool = False
    carve_failure_cooldown: float = 300.0
    warm: WarmSettings = field(default_factory=WarmSettings)
    nvml_timeout: float | None = 20.0  # None: no deadline
    mps_daemon_image: str | None = None
    mps_daemon_namespace: str | None = None
    mps_daemon_service_account: str | None = None
    mps_daemon_pull_policy: str = "IfNotPresent"
    controller_lease: tuple[str, str] | None = None  # (namespace, name); None: not checked


def parse_options(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Options:
    """Flags, then the environment, then defaults; UsageError for anything unusable."""
    got = COMMAND_LINE.parse(argv, env)
    driver = got[flags.DRIVER_NAME]
    try:
        health = HealthPolicy(
            fatal_xids=got[FATAL_XIDS],
            ignored_xids=got[IGNORED_XIDS],
            fatal_effect=TaintEffect(got[FATAL_TAINT_EFFECT]),
            degraded_effect=TaintEffect(got[DEGRADED_TAINT_EFFECT]),
            recovery_seconds=got[HEALTH_RECOVERY],
        )
    except HealthConfigError as e:
        raise flags.UsageError(f"{PROG}: --fatal-xids / --ignored-xids: {e}") from e
    if got[MPS_DAEMON_IMAGE] and not got[MPS_DAEMON_NAMESPACE]:
        raise flags.UsageError(
            f"{PROG}: --mps-daemon-image needs --mps-daemon-namespace (the plugin's own "
            "namespace, e.g. --mps-daemon-namespace=carve-system)"
        )
    lease, lease_ref = None, got[CONTROLLER_LEASE]
    if lease_ref:
        from kubeletplugin.controllerskew import parse_lease_ref

        try:
            lease = parse_lease_ref(lease_ref)
        except ValueError as e:
            raise flags.UsageError(f"{PROG}: --controller-lease: {e}") from e
    return Options(
        node_name=got[NODE_NAME],
        driver_name=driver,
        kubeconfig=got[flags.KUBECONFIG],
        registry_dir=got[REGISTRY_DIR],
        plugins_dir=got[PLUGINS_DIR],
        cdi_root=got[CDI_ROOT],
        checkpoint_dir=got[CHECKPOINT_DIR] or got[PLUGINS_DIR] / driver,
        foreign_instances=got[FOREIGN_INSTANCES],
        simulate=got[SIMULATE],
        http_address=got[HTTP_ADDRESS],
        resync_period=got[RESYNC_PERIOD],
        log_format=got[flags.LOG_FORMAT],
        log_level=got[flags.LOG_LEVEL],
        cleanup=got[CLEANUP],
        cleanup_on_exit=got[CLEANUP_ON_EXIT],
        no_publish=got[NO_PUBLISH],
        deprecations=got.deprecations,
        driver_root=got[DRIVER_ROOT].absolute(),
        dev_root=got[DEV_ROOT].absolute(),
        health=health,
        health_poll_period=got[HEALTH_POLL],
        binding_conditions=got[BINDING_CONDITIONS],
        carve_failure_cooldown=got[CARVE_FAILURE_COOLDOWN],
        warm=WarmSettings(got[WARM_SLICES_TTL], got[WARM_SLICES_ACROSS_NAMESPACES]),
        nvml_timeout=got[NVML_TIMEOUT] or None,
        mps_daemon_image=got[MPS_DAEMON_IMAGE],
        mps_daemon_namespace=got[MPS_DAEMON_NAMESPACE],
        mps_daemon_service_account=got[MPS_DAEMON_SERVICE_ACCOUNT],
        mps_daemon_pull_policy=got[MPS_DAEMON_IMAGE_PULL_POLICY],
        controller_lease=lease,
    )
