"""The per-node configuration files (pure): each node's paths, ports and networks are its own,
and the files parse as the programs that read them expect."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from realnode import configs
from realnode.layout import NodeLayout


def _layout(index: int = 3, root: Path = Path("/tmp/carve-rn-abcdefgh/n3")) -> NodeLayout:
    return NodeLayout(
        name=f"node-{index}", index=index, root=root, kubelet_port=40000, kubelet_healthz_port=40001
    )


def test_containerd_config_is_the_nodes_own() -> None:
    lay = _layout()
    text = configs.containerd_config(
        lay, pause_image="carve.local/pause:3.10", runc=Path("/usr/sbin/runc"),
        cni_bin_dirs=(Path("/usr/lib/cni"),),
    )  # fmt: skip
    doc = tomllib.loads(text)
    plugins = doc["plugins"]
    assert doc["version"] == 4
    assert doc["root"].startswith(str(lay.root)) and doc["state"].startswith(str(lay.root))
    assert plugins["io.containerd.server.v1.grpc"]["address"] == str(lay.containerd_socket)
    runtime = plugins["io.containerd.cri.v1.runtime"]
    assert runtime["cdi_spec_dirs"] == [str(lay.cdi_dir)]
    assert runtime["restrict_oom_score_adj"] is True
    assert runtime["cni"]["conf_dir"] == str(lay.cni_conf_dir)
    options = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert options["Root"].startswith(str(lay.root)) and options["SystemdCgroup"] is False
    assert plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"].startswith("carve")


def test_a_path_toml_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be written"):
        configs.containerd_config(
            _layout(root=Path('/tmp/a"b')), pause_image="p", runc=Path("/r"), cni_bin_dirs=()
        )


def test_kubelet_config_runs_beside_other_kubelets_on_cgroup_v1() -> None:
    lay = _layout()
    cfg = configs.kubelet_config(lay)
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["cgroupRoot"] == "/carve-node-3"
    assert cfg["address"] == lay.node_ip == "10.200.0.3"
    assert cfg["port"] == 40000 and cfg["readOnlyPort"] == 0
    assert cfg["containerRuntimeEndpoint"] == f"unix://{lay.containerd_socket}"
    assert cfg["podLogsDir"].startswith(str(lay.root))
    argv = configs.kubelet_args(Path("/bin/kubelet"), lay, {"b": "2", "a": "1"})
    assert f"--root-dir={lay.kubelet_root}" in argv
    assert "--node-labels=a=1,b=2" in argv and "--hostname-override=node-3" in argv


@given(st.integers(min_value=1, max_value=249), st.integers(min_value=1, max_value=249))
def test_two_nodes_never_share_a_bridge_subnet_or_ip(a: int, b: int) -> None:
    one, two = _layout(a), _layout(b)
    same = a == b
    assert (one.bridge == two.bridge) is same
    assert (one.pod_subnet == two.pod_subnet) is same
    assert (one.node_ip == two.node_ip) is same
    assert len(one.bridge) <= 15  # the kernel's limit on interface names


def test_cni_conflist_keeps_ipam_state_under_the_node() -> None:
    lay = _layout()
    doc = configs.cni_conflist(lay)
    bridge = doc["plugins"][0]
    assert bridge["bridge"] == lay.bridge
    assert bridge["ipam"]["dataDir"] == str(lay.cni_ipam_dir)
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.201.3.0/24"}]]


def test_socket_paths_fit_the_unix_limit() -> None:
    lay = _layout(249)
    for sock in (lay.containerd_socket, lay.registry_dir / "mig.carve.dev-reg.sock"):
        assert len(str(sock)) < 108, sock
