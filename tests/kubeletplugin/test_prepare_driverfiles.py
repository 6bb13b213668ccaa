"""The claim's CDI spec on a node with a driver root and a dev root (issue 9, a real node).

The simulator fills both roots; the plugin's own discovery (driver.driverroot) and CDI code do
the rest, exactly as on hardware. The written spec is resolved as a runtime resolves it, and
the nvidia-smi it mounts is run with the environment it sets.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from driver import cdi
from driver.cdi import CdiWriter
from driver.driverroot import DriverRootError, discover
from driver.nvml import sim
from driver.nvml.sim import driverfiles
from kubeletplugin import nodehardware
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.main import NodePlugin
from kubeletplugin.nodehardware import NodeHardware
from kubeletplugin.options import parse_options
from kubeletplugin.prepare import Preparer, PreparerSettings
from process.kube.jsonclient import KubeJson
from process.kubeconfig import load_api_client
from tests.kubeletplugin.node_harness import DRIVER, NODE, Node, mig, open_node, whole

H100 = "H100-SXM5-80GB"
REPO = Path(__file__).resolve().parents[2]
PLUGIN = str(Path(sys.executable).with_name("carve-kubelet-plugin"))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = open_node(tmp_path, [H100, H100])
    sim.sim_node_files(tmp_path / "driver", tmp_path / "devroot")
    files = discover(tmp_path / "driver", version=n.backend.gpus()[0].driver_version, hook_dirs=())
    n.preparer = Preparer(
        settings=PreparerSettings(DRIVER, NODE, NODE),
        backend=n.backend,
        claims=n.claims,
        store=CheckpointStore(n.checkpoint_dir),
        cdi=CdiWriter(n.cdi_root, vendor=DRIVER),
        common_nodes=NodeHardware(n.backend, sim.sim_proc_root()).common_device_nodes(),
        shared_edits=files.spec_edits(),
        dev_root=tmp_path / "devroot",
    )
    n.p.reconcile()
    yield n
    n.p.close()
    n.backend.close()
    sim.configure(None)


def test_spec_mounts_the_driver_and_names_the_host_nodes(node: Node, tmp_path: Path) -> None:
    dev = mig(node.backend, 1, 19, 3)
    ref = node.claims.add("c1", [dev, whole(0)])
    result = node.p.prepare([ref])[ref.uid]
    assert result.error == ""
    spec = cdi.load_spec(node.cdi_root / f"{DRIVER}-claim_{ref.uid}.json")
    assert spec["cdiVersion"] == "0.5.0"  # hostPath on device nodes

    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    assert "/usr/bin/nvidia-smi" in mounts
    assert {p.rsplit("/", 1)[1].split(".so")[0] for p in mounts if ".so." in p} == {
        "libnvidia-ml",
        "libcuda",
    }
    for path, m in mounts.items():
        assert m["hostPath"] == f"{tmp_path / 'driver'}{path}"
        assert m["options"] == ["ro", "nosuid", "nodev", "bind"]
        assert Path(m["hostPath"]).is_file()
    assert "hooks" not in spec["containerEdits"]  # no toolkit hook binary was searched for

    ids = [c for d in result.devices for c in d.cdi_device_ids]
    edits = cdi.resolve([node.cdi_root], ids)
    assert len(edits.mounts) == len(mounts)  # once per spec, not once per device
    paths = set()
    for n in edits.device_nodes:
        assert n["hostPath"] == f"{tmp_path / 'devroot'}{n['path']}"
        paths.add(n["path"])
        if os.geteuid() == 0:  # the simulator made the very node the spec describes
            st = os.lstat(n["hostPath"])
            assert stat.S_ISCHR(st.st_mode)
            assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (n["major"], n["minor"])
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= paths

    # What a container given the MIG request would run: the mounted nvidia-smi with the
    # environment of that request's CDI device (the kubelet passes only those).
    mig_edits = cdi.resolve([node.cdi_root], result.devices[0].cdi_device_ids)
    env = dict(e.split("=", 1) for e in mig_edits.env)
    out = subprocess.run(
        ["/bin/sh", mounts["/usr/bin/nvidia-smi"]["hostPath"], "-L"],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES": env["NVIDIA_VISIBLE_DEVICES"]},
    ).stdout
    record = node.p.checkpoint().claims[ref.uid]
    mig_uuid = next(d.mig_uuid for d in record.devices if d.is_mig)
    assert f"(UUID: {mig_uuid})" in out
    assert out.count("MIG ") == 1 and out.count("GPU ") == 1  # the slice under its GPU

    assert node.p.unprepare([ref]) == {ref.uid: ""}
    if os.geteuid() == 0:
        caps = sorted(p.name for p in (tmp_path / "devroot/dev/nvidia-caps").iterdir())
        assert caps == ["nvidia-cap1", "nvidia-cap2"]


def test_without_shared_edits_the_spec_is_as_before(tmp_path: Path) -> None:
    n = open_node(tmp_path, [H100])
    n.start()
    try:
        ref = n.claims.add("c1", [mig(n.backend, 0, 19, 0)])
        assert n.p.prepare([ref])[ref.uid].error == ""
        spec = cdi.load_spec(n.cdi_root / f"{DRIVER}-claim_{ref.uid}.json")
        assert "containerEdits" not in spec
        nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
        assert all("hostPath" not in x for x in nodes)
    finally:
        n.p.close()
        n.backend.close()
        sim.configure(None)


# --- the plugin's start-up: flags, discovery once, refusal on real hardware --------------------


def _kubeconfig(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def _sim_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(yaml.safe_dump({"state": str(tmp_path / "state.json"), "gpus": [H100]}))
    return cfg


def _plugin(tmp_path: Path, *argv: str) -> NodePlugin:
    opts = parse_options(
        [
            "--node-name=n1",
            f"--plugins-dir={tmp_path / 'plugins'}",
            f"--registry-dir={tmp_path / 'registry'}",
            f"--cdi-root={tmp_path / 'cdi'}",
            "--http-address=",
            *argv,
        ],
        {},
    )
    return NodePlugin(opts, KubeJson(load_api_client(str(_kubeconfig(tmp_path / "kc")))))


def _close(plugin: NodePlugin) -> None:
    plugin.preparer.close()
    plugin.node.close()
    sim.configure(None)


def test_flags_default_to_the_root() -> None:
    o = parse_options(["--node-name=n"], {})
    assert (o.driver_root, o.dev_root) == (Path("/"), Path("/"))
    o = parse_options(["--node-name=n"], {"CARVE_DRIVER_ROOT": "/run/nvidia/driver"})
    assert o.driver_root == Path("/run/nvidia/driver")
    o = parse_options(["--node-name=n", "--driver-root=rel", "--dev-root=/d"], {})
    assert o.driver_root == Path.cwd() / "rel" and o.dev_root == Path("/d")


def test_simulated_node_with_roots_discovers_its_driver_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _sim_config(tmp_path)
    monkeypatch.setenv("CARVE_SIM_CONFIG", str(cfg))  # open_backend sets it; restored after
    plugin = _plugin(
        tmp_path,
        f"--simulate={cfg}",
        f"--driver-root={tmp_path / 'driver'}",
        f"--dev-root={tmp_path / 'devroot'}",
    )
    try:
        files = plugin.driver_files
        assert files is not None and files.root == tmp_path / "driver"
        assert files.version == plugin.node.mig.gpus()[0].driver_version
        assert "/usr/bin/nvidia-smi" in [m.container_path for m in files.mounts]
        assert (tmp_path / "driver/usr/bin/nvidia-smi").is_file()
    finally:
        _close(plugin)


def test_simulated_node_without_roots_keeps_specs_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _sim_config(tmp_path)
    monkeypatch.setenv("CARVE_SIM_CONFIG", str(cfg))
    plugin = _plugin(tmp_path, f"--simulate={cfg}")
    try:
        assert plugin.driver_files is None
        assert not (tmp_path / "driver").exists()
    finally:
        _close(plugin)


def test_real_hardware_without_a_driver_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Real-hardware mode (no --simulate) on simulated GPUs: only the driver root is in question.
    n = open_node(tmp_path, [H100])
    monkeypatch.setattr(
        nodehardware,
        "open_backend",
        lambda simulate, driver_root, **_: NodeHardware(n.backend, sim.sim_proc_root()),
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(DriverRootError) as err:
        _plugin(tmp_path, f"--driver-root={tmp_path / 'empty'}")
    message = str(err.value)
    assert f"no NVIDIA driver {n.backend.gpus()[0].driver_version} under driver root" in message
    assert "--driver-root" in message and "/run/nvidia/driver" in message

    # With a driver there (here: the simulator's), the same start-up finds it, and says once
    # that without the toolkit's hook binary the specs carry no hooks.
    sim.sim_node_files(tmp_path / "driver", None)
    monkeypatch.setattr("driver.driverroot.HOST_HOOK_DIRS", ())
    with caplog.at_level(logging.INFO, logger="carve.kubeletplugin"):
        plugin = _plugin(tmp_path, f"--driver-root={tmp_path / 'driver'}")
    try:
        assert plugin.driver_files is not None
        warned = [r for r in caplog.records if "no nvidia-cdi-hook or nvidia-ctk" in r.getMessage()]
        assert plugin.driver_files.hook_binary is None and plugin.driver_files.hooks == ()
        assert len(warned) == 1
    finally:
        _close(plugin)


def test_the_process_exits_1_with_one_line_when_the_driver_root_is_not_the_simulators(
    tmp_path: Path,
) -> None:
    libdir = tmp_path / "driver" / driverfiles.library_dir()
    libdir.mkdir(parents=True)
    (libdir / "libcuda.so.580.105.08").write_bytes(b"\x7fELF")
    out = subprocess.run(
        [
            PLUGIN,
            "--node-name=n1",
            f"--kubeconfig={_kubeconfig(tmp_path / 'kc')}",
            f"--simulate={_sim_config(tmp_path)}",
            f"--driver-root={tmp_path / 'driver'}",
            f"--plugins-dir={tmp_path / 'plugins'}",
            f"--cdi-root={tmp_path / 'cdi'}",
            "--http-address=",
            "--log-format=text",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 1, out.stderr
    assert "looks like a real driver root" in out.stderr
    assert "Traceback" not in out.stderr
