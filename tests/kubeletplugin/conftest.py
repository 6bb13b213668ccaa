"""The plugin's cluster tests (test_main, test_publisher) share one control plane per session.

The devcluster fixtures are imported by name: pytest accepts `pytest_plugins` only in the
top-level conftest, and there it would hand every suite the same cluster.
"""

from devcluster.pytest_plugin import (  # noqa: F401  (fixtures)
    fake_node,
    k8s_api,
    k8s_cluster,
    namespace,
    node_heartbeater,
)
