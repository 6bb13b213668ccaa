"""The `carve` command: what a person runs to look at MIG slices on a node or in a cluster.

It is a third program beside the controller and the kubelet plugin, not part of the shared
core: it only reads (NVML on one node, the API for the cluster) and prints, so it may use the
core (`driver`) but the core and the two binaries never depend on it.
"""
