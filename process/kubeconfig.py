"""The Kubernetes API client every carve binary talks through.

A kubeconfig file when one is named (`--kubeconfig`, `CARVE_KUBECONFIG`, `KUBECONFIG`), else the
pod's in-cluster service-account config. Each client gets its own `Configuration` instead of the
library's process-wide default, so a test process can run a controller and plugins against
different clusters side by side.
"""

from __future__ import annotations

from typing import Any

Timeout = float | tuple[float, float]
"""A client timeout as the Kubernetes client takes it: seconds in all, or (connect, read)."""


class KubeconfigError(Exception):
    """No usable API configuration: the file is missing or broken, or not running in a pod."""


def load_api_client(
    kubeconfig: str | None,
    *,
    connections: int | None = None,
    request_timeout: Timeout | None = None,
    retries: int | None = None,
) -> Any:
    """An `ApiClient` for `kubeconfig`, or the in-cluster config when it is None.

    `connections`: how many HTTP connections to keep open at once, for a process whose threads
    talk to the apiserver in parallel (the client's default is five per CPU; a thread finding
    the pool full opens a connection, TLS handshake included, and throws it away after).

    `request_timeout`: the timeout of every request that does not set its own
    (`_request_timeout`). The client's default is none at all: a request on a half-open
    connection (a peer that vanished without a FIN, a stalled proxy) then blocks its thread
    forever, be it a commit worker holding a placement or a leader's lease renewal.

    `retries`: how many times urllib3 tries a request again after a connection or read error
    (a timeout included), each time with the whole timeout again. The client's default, None,
    is urllib3's three: a request to an apiserver that accepts connections and never answers
    then takes four timeouts (40 s at the node agent's 10 s) before its caller hears of it."""
    from kubernetes import client, config

    loader: Any = config  # the config loaders are untyped
    cfg = client.Configuration()
    if retries is not None:
        cfg.retries = retries
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
    if request_timeout is None:
        return client.ApiClient(cfg)
    return _timed_client_class()(cfg, request_timeout)


_TIMED: list[type] = []


def _timed_client_class() -> type:
    """`ApiClient` with a default timeout, made on first use: the client library is imported
    only by the binaries that talk to an apiserver, never at module import."""
    if _TIMED:
        return _TIMED[0]
    from kubernetes import client

    class TimedApiClient(client.ApiClient):
        """Every request without a timeout of its own gets `default_timeout`; every generated
        API method ends in `call_api`, and a timeout given there (a watch's) is kept."""

        def __init__(self, configuration: Any, default_timeout: Timeout) -> None:
            super().__init__(configuration)
            self.default_timeout = default_timeout

        def call_api(self, *args: Any, **kwargs: Any) -> Any:
            if len(args) < 6 and kwargs.get("_request_timeout") is None:
                kwargs["_request_timeout"] = self.default_timeout
            return super().call_api(*args, **kwargs)

    _TIMED.append(TimedApiClient)
    return TimedApiClient
