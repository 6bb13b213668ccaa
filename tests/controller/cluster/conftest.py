"""Controller suites on the real control plane (kube-apiserver, kube-scheduler, KCM v1.37).

The devcluster fixtures are imported rather than declared through `pytest_plugins`, which
pytest accepts only in the top-level conftest.
"""

from devcluster.pytest_plugin import (  # noqa: F401  (fixtures)
    fake_node,
    k8s_api,
    k8s_cluster,
    namespace,
    node_heartbeater,
)
