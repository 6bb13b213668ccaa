"""The Kubernetes API client every carve binary talks through.

A kubeconfig file when one is named (`--kubeconfig`, `CARVE_KUBECONFIG`, `KUBECONFIG`), else the
pod's in-cluster service-account config. Each client gets its own `Configuration` instead of the
library's process-wide default, so a test process can run a controller and plugins against
different clusters side by side.
"""

from __future__ import annotations

from typing import Any


class KubeconfigError(Exception):
    """No usable API configuration: the file is missing or broken, or not running in a pod."""


def load_api_client(kubeconfig: str | None, *, connections: int | None = None) -> Any:
    """An `ApiClient` for `kubeconfig`, or the in-cluster config when it is None.

    `connections`: how many HTTP connections to keep open at once, for a process whose threads
    talk to the apiserver in parallel (the client's default is five per CPU; a thread finding
    the pool full opens a connection, TLS handshake included, and throws it away after)."""
    from kubernetes import client, config

    loader: Any = config  # the config loaders are untyped
    cfg = client.Configuration()
    if connections is not None:
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize, connections)
    try:
        if kubeconfig:
            loader.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            loader.load_incluster_config(client_configuration=cfg)
    except (loader.ConfigException, OSError) as e:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster config"
        raise KubeconfigError(f"cannot load {where}: {e}") from e
    return client.ApiClient(cfg)
