"""Real service-account credentials for the tests that check what the apiserver lets a carve
component do (tests/deploy): a token as the kubelet gets one for a pod, an API client that
sends only that token, and a kubeconfig holding it for a process (carve-controller) to run as
that account.

A token bound to a pod carries the pod's name and node (`authentication.kubernetes.io/...`
extras), which carve's admission policies read: the plugin's node, the controller replica
that holds the leader Lease. It stays valid while the pod exists, so a test creates a
stand-in pod (scheduled nowhere) for the identity it needs.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from devcluster.cluster import api_client_for


def service_account_token(
    core: client.CoreV1Api,
    account: str,
    namespace: str,
    pod: str | None,
    seconds: int = 600,
) -> str:
    """A token of `account`, bound to `pod` (so it names the pod and its node) or, with no
    pod, one that names neither."""
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": seconds}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod}
    request: Any = {"spec": spec}  # the client takes the JSON shape as its model
    resp = core.create_namespaced_service_account_token(account, namespace, request)
    assert resp.status is not None, resp
    return str(resp.status.token)


def client_as(kubeconfig: Path, token: str) -> client.ApiClient:
    """The cluster of `kubeconfig` (its server and CA), authenticated by `token` alone: the
    admin's client certificate is dropped, else the apiserver would see the admin."""
    api = api_client_for(kubeconfig)
    cfg = api.configuration
    cfg.api_key = {"authorization": f"Bearer {token}"}
    cfg.cert_file = cfg.key_file = None
    return client.ApiClient(cfg)


def token_kubeconfig(kubeconfig: Path, token: str, path: Path) -> Path:
    """A kubeconfig for `kubeconfig`'s cluster (server and CA) whose only credential is
    `token`, written to `path`: what a process started with `--kubeconfig` runs as."""
    doc = yaml.safe_load(kubeconfig.read_text())
    cluster = doc["clusters"][0]["cluster"]
    ca = cluster.get("certificate-authority-data")
    if ca is None:
        ca = base64.b64encode(Path(cluster["certificate-authority"]).read_bytes()).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "cluster",
                        "cluster": {"server": cluster["server"], "certificate-authority-data": ca},
                    }
                ],
                "users": [{"name": "token", "user": {"token": token}}],
                "contexts": [{"name": "token", "context": {"cluster": "cluster", "user": "token"}}],
                "current-context": "token",
            }
        )
    )
    return path
