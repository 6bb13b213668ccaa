"""The control-plane regression suite shares one cluster per session (devcluster fixtures;
imported because pytest accepts `pytest_plugins` only in the top-level conftest)."""

from devcluster.pytest_plugin import (  # noqa: F401  (fixtures)
    fake_node,
    k8s_api,
    k8s_cluster,
    namespace,
    node_heartbeater,
)
