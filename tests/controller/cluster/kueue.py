"""The real Kueue (v0.17.0, hack/kueue/build.sh) installed into a devcluster and run beside it.

What a Kueue install does, minus the Deployment: its CRDs (with the conversion-webhook patches of
its kustomization), its webhook configurations, the `kueue-system` namespace, the Secret that its
internal certificate manager fills, and a Service for its webhook server. No kube-proxy runs
here, so the Service has no selector and one EndpointSlice pointing at this machine's address
(the devcluster's apiserver routes webhooks through EndpointSlices, and EndpointSlices refuse
loopback addresses); the manager's cert-controller issues the serving certificate for
`kueue-webhook-service.kueue-system.svc` and injects its CA into the webhook configurations and
CRDs, exactly as in a cluster. The apiserver therefore calls Kueue's real webhooks.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from devcluster.waiting import wait_for
from driver.apiobject import Obj
from tests.controller.cluster.objects import REPO

KUEUE_VERSION = "v0.17.0"
KUEUE_BUILD = REPO / "hack" / "kueue" / "build.sh"
KUEUE_NS = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGED_LABEL = "carve.test/kueue"
"""Namespaces labelled with this (value "on") are managed by Kueue and go through its pod
webhooks; every other namespace of the suite's cluster is left alone."""
_PREFIX = "kueue-"  # the kustomization's namePrefix


def kueue_dist() -> Path:
    """The built version directory (bin/kueue, config/); skips without Go, as the other
    Go-built tools do, unless CARVE_REQUIRE_CLUSTER says this machine must have it."""
    env = {**os.environ, "PATH": os.pathsep.join(("/usr/local/go/bin", os.environ["PATH"]))}
    done = subprocess.run(
        ["bash", str(KUEUE_BUILD)], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode == 0:
        return Path(done.stdout.strip())
    reason = f"kueue unavailable (hack/kueue/build.sh exit {done.returncode}): {done.stderr[-800:]}"
    if done.returncode == 2 and not os.environ.get("CARVE_REQUIRE_CLUSTER"):
        pytest.skip(reason)
    raise RuntimeError(reason)


def _docs(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _service_ref(path: str | None = None) -> Obj:
    ref: Obj = {"namespace": KUEUE_NS, "name": SERVICE}
    if path:
        ref["path"] = path
    return ref


def crds(dist: Path) -> list[Obj]:
    """The CRDs with the conversion webhook that Kueue's kustomization patches in, pointed at
    the webhook Service as kustomize's namespace and namePrefix would."""
    crd_dir = dist / "config" / "crd"
    out = {
        d["metadata"]["name"]: d
        for p in sorted((crd_dir / "bases").glob("*.yaml"))
        for d in _docs(p)
    }
    listed = yaml.safe_load((crd_dir / "kustomization.yaml").read_text())
    for entry in listed.get("patches") or []:
        for patch in _docs(crd_dir / entry["path"]):
            conversion = patch["spec"]["conversion"]
            conversion["webhook"]["clientConfig"]["service"] = _service_ref(
                conversion["webhook"]["clientConfig"]["service"].get("path")
            )
            out[patch["metadata"]["name"]]["spec"]["conversion"] = conversion
    return list(out.values())


def _wanted(hook: Obj) -> bool:
    """Pods (the one integration enabled) and Kueue's own objects; a webhook of a framework
    the manager does not run would refuse every Deployment or Job of the suite."""
    path = str(hook["clientConfig"]["service"]["path"])
    return path.endswith("-v1-pod") or "-kueue-x-k8s-io-" in path


def webhook_configurations(dist: Path) -> list[Obj]:
    out = []
    for doc in _docs(dist / "config" / "webhook" / "manifests.yaml"):
        doc["metadata"] = {"name": _PREFIX + doc["metadata"]["name"]}
        hooks = [h for h in doc["webhooks"] if _wanted(h)]
        for h in hooks:
            h["clientConfig"]["service"] = _service_ref(h["clientConfig"]["service"]["path"])
            if h["clientConfig"]["service"]["path"].endswith("-v1-pod"):
                h["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "on"}}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def host_address() -> str:
    """This machine's outbound IPv4 address (no packet is sent: a UDP socket only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))
            addr = str(s.getsockname()[0])
        except OSError:
            addr = ""
    if not addr or addr.startswith("127."):
        if os.environ.get("CARVE_REQUIRE_CLUSTER"):
            raise RuntimeError(
                "CARVE_REQUIRE_CLUSTER is set but this machine has no non-loopback IPv4 address "
                "for Kueue's webhook EndpointSlice"
            )
        pytest.skip(
            "no non-loopback IPv4 address: the apiserver cannot reach Kueue's webhook through "
            "an EndpointSlice (which refuses loopback addresses)"
        )
    return addr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def configuration(
    user: Mapping[str, Any],
    *,
    webhook_port: int,
    health_port: int,
    metrics_port: int,
    cert_dir: Path,
) -> Obj:
    """The user's Configuration (what docs/guide/kueue.md shows: feature gates, integrations,
    DRA mappings) plus what running beside a test cluster needs: free local ports, no leader
    election, internal certificates, only labelled namespaces, no visibility API server."""
    config: Obj = {k: v for k, v in user.items() if k not in ("apiVersion", "kind")}
    config.update(
        {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": KUEUE_NS,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
            "webhook": {"port": webhook_port, "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": SERVICE,
                "webhookSecretName": SECRET,
            },
            "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "on"}},
            "featureGates": {**user.get("featureGates", {}), "VisibilityOnDemand": False},
        }
    )
    return config


def _create(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except ApiException as exc:
        if exc.status != 409:
            raise


def install(api: ApiClient, dist: Path, address: str, webhook_port: int) -> None:
    """CRDs, webhook configurations and the webhook's namespace, Secret and Service."""
    ext = client.ApiextensionsV1Api(api)
    core = client.CoreV1Api(api)
    adm = client.AdmissionregistrationV1Api(api)
    for crd in crds(dist):
        _create(ext.create_custom_resource_definition, crd)
    _create(core.create_namespace, {"metadata": {"name": KUEUE_NS}})
    _create(
        core.create_namespaced_secret,
        KUEUE_NS,
        {"metadata": {"name": SECRET}, "type": "Opaque"},
    )
    _create(
        core.create_namespaced_service,
        KUEUE_NS,
        {
            "metadata": {"name": SERVICE},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": webhook_port}]},
        },
    )
    # One address, re-pointed at this run's port: a suite may start Kueue more than once.
    disc = client.DiscoveryV1Api(api)
    slice_body = {
        "metadata": {"name": SERVICE, "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": webhook_port, "protocol": "TCP"}],
    }
    try:
        disc.create_namespaced_endpoint_slice(KUEUE_NS, slice_body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        disc.replace_namespaced_endpoint_slice(SERVICE, KUEUE_NS, slice_body)
    for conf in webhook_configurations(dist):
        name = conf["metadata"]["name"]
        if conf["kind"] == "MutatingWebhookConfiguration":
            _create(adm.create_mutating_webhook_configuration, conf)
        else:
            _create(adm.create_validating_webhook_configuration, conf)
    for crd in crds(dist):
        name = crd["metadata"]["name"]
        wait_for(f"CRD {name} established", lambda n=name: _established(ext, n), timeout=30)


def uninstall_webhooks(api: ApiClient, dist: Path) -> None:
    """Without a running manager the webhooks (failurePolicy Fail) would refuse every pod of a
    labelled namespace and every Kueue object: remove them with the manager."""
    adm = client.AdmissionregistrationV1Api(api)
    for conf in webhook_configurations(dist):
        name = conf["metadata"]["name"]
        try:
            if conf["kind"] == "MutatingWebhookConfiguration":
                adm.delete_mutating_webhook_configuration(name)
            else:
                adm.delete_validating_webhook_configuration(name)
        except ApiException as exc:
            if exc.status != 404:
                raise


def _established(ext: Any, name: str) -> bool:
    crd = ext.read_custom_resource_definition(name, _preload_content=False)
    conds = (json.loads(crd.data).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)


def _ca_injected(api: ApiClient, dist: Path) -> bool:
    adm = client.AdmissionregistrationV1Api(api)
    for conf in webhook_configurations(dist):
        name = conf["metadata"]["name"]
        if conf["kind"] == "MutatingWebhookConfiguration":
            live = adm.read_mutating_webhook_configuration(name, _preload_content=False)
        else:
            live = adm.read_validating_webhook_configuration(name, _preload_content=False)
        if not all(h["clientConfig"].get("caBundle") for h in json.loads(live.data)["webhooks"]):
            return False
    return True


class SecretVolume:
    """The kubelet's part: Kueue's cert-controller fills the Secret and then waits until the
    certificate appears in `certDir`, where a Deployment mounts that Secret as a volume. This
    thread copies the Secret's keys there (key before certificate, each file replaced whole)
    and keeps them in step, as the kubelet's volume manager does."""

    def __init__(self, api: ApiClient, directory: Path) -> None:
        self._core = client.CoreV1Api(api)
        self._dir = directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kueue-cert-volume", daemon=True)

    def start(self) -> SecretVolume:
        self._dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        written: dict[str, bytes] = {}
        while not self._stop.wait(0.2):
            try:
                secret = self._core.read_namespaced_secret(SECRET, KUEUE_NS)
            except ApiException:
                continue
            data = secret.data or {}
            for key in ("ca.crt", "tls.key", "tls.crt"):
                if key not in data:
                    break
                content = base64.b64decode(data[key])
                if written.get(key) != content:
                    tmp = self._dir / f".{key}.tmp"
                    tmp.write_bytes(content)
                    tmp.replace(self._dir / key)
                    written[key] = content


@dataclass
class KueueProcess:
    """The manager as a process, with its log kept for post-mortems."""

    proc: subprocess.Popen[bytes]
    log: Path
    health_port: int
    volume: SecretVolume

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"kueue exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/readyz", timeout=2
            ) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.volume.stop()


def start(
    api: ApiClient,
    dist: Path,
    kubeconfig: Path,
    workdir: Path,
    user_config: Mapping[str, Any],
) -> KueueProcess:
    """Install Kueue, start its manager, and return once its webhooks answer."""
    webhook_port, health_port, metrics_port = free_port(), free_port(), free_port()
    install(api, dist, host_address(), webhook_port)
    config = workdir / "kueue-config.yaml"
    config.write_text(
        yaml.safe_dump(
            configuration(
                user_config,
                webhook_port=webhook_port,
                health_port=health_port,
                metrics_port=metrics_port,
                cert_dir=workdir / "kueue-certs",
            )
        )
    )
    log = workdir / "kueue.log"
    out = log.open("ab")
    volume = SecretVolume(api, workdir / "kueue-certs").start()
    proc = subprocess.Popen(
        [str(dist / "bin" / "kueue"), f"--config={config}", "--zap-log-level=2"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
    )
    kueue = KueueProcess(proc, log, health_port, volume)
    started = time.monotonic()
    try:
        wait_for("kueue's readiness probe", kueue.healthy, timeout=90)
        wait_for("kueue's CA in its webhook configurations", lambda: _ca_injected(api, dist), 60)
    except BaseException:
        kueue.stop()
        print(kueue.tail())
        raise
    print(f"kueue {KUEUE_VERSION} ready in {time.monotonic() - started:.1f}s")
    return kueue


def custom(api: ApiClient) -> Any:
    return client.CustomObjectsApi(api)


_PLURALS = {
    "ResourceFlavor": "resourceflavors",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
}


def create(api: ApiClient, ns: str, obj: Obj) -> None:
    """A Kueue object as a manifest shows it; namespaced kinds go to `ns`."""
    group, _, version = obj["apiVersion"].partition("/")
    plural = _PLURALS[obj["kind"]]
    if obj["kind"] == "LocalQueue":
        custom(api).create_namespaced_custom_object(group, version, ns, plural, obj)
    else:
        custom(api).create_cluster_custom_object(group, version, plural, obj)


def workloads(api: ApiClient, ns: str) -> list[Obj]:
    items: list[Obj] = custom(api).list_namespaced_custom_object(GROUP, VERSION, ns, "workloads")[
        "items"
    ]
    return items


def has_condition(workload: Obj, kind: str) -> bool:
    conds = (workload.get("status") or {}).get("conditions") or []
    return any(c["type"] == kind and c["status"] == "True" for c in conds)


def is_admitted(workload: Obj) -> bool:
    return has_condition(workload, "Admitted")


def _unfinalize(patch: Any, *args: Any) -> None:
    try:
        patch(*args, {"metadata": {"finalizers": None}})
    except ApiException as exc:
        if exc.status != 404:
            raise


def release_namespace(api: ApiClient, ns: str) -> None:
    """With the manager stopped nobody removes Kueue's finalizers: drop them from what the test
    made (pods, workloads, queues, flavors) so the namespace and the objects can be deleted."""
    core, co = client.CoreV1Api(api), custom(api)
    for p in core.list_namespaced_pod(ns).items:
        _unfinalize(core.patch_namespaced_pod, p.metadata.name, ns)
    for plural in ("workloads", "localqueues"):
        for obj in co.list_namespaced_custom_object(GROUP, VERSION, ns, plural)["items"]:
            name = obj["metadata"]["name"]
            _unfinalize(co.patch_namespaced_custom_object, GROUP, VERSION, ns, plural, name)
            co.delete_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
    for plural in ("clusterqueues", "resourceflavors"):
        for obj in co.list_cluster_custom_object(GROUP, VERSION, plural)["items"]:
            name = obj["metadata"]["name"]
            _unfinalize(co.patch_cluster_custom_object, GROUP, VERSION, plural, name)
            co.delete_cluster_custom_object(GROUP, VERSION, plural, name)
