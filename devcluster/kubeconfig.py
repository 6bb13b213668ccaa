"""Kubeconfig files with embedded credentials, so one file is all a client needs."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from devcluster.pki import CertificateFiles


def kubeconfig_document(
    server: str, ca_cert: Path, client: CertificateFiles, user: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "devcluster",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": _b64(ca_cert),
                },
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert),
                    "client-key-data": _b64(client.key),
                },
            }
        ],
        "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": user}}],
        "current-context": "devcluster",
    }


def write_kubeconfig(
    path: Path, server: str, ca_cert: Path, client: CertificateFiles, user: str
) -> Path:
    path.write_text(yaml.safe_dump(kubeconfig_document(server, ca_cert, client, user)))
    path.chmod(0o600)
    return path


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode("ascii")
