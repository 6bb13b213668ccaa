"""The real carve-kubelet-plugin process refuses to start on a checkpoint it cannot read.

Runs the same process harness as test_main (no apiserver is needed: the checkpoint is loaded
before the plugin talks to the API or serves a socket).
"""

from __future__ import annotations

import json
from pathlib import Path

from kubeletplugin.agentlock import LOCK_FILE
from kubeletplugin.checkpoint import FILE_NAME, READ_VERSIONS
from tests.support.plugin_process import DRIVER, PluginProcess, unreachable_kubeconfig


def test_plugin_refuses_to_start_on_a_checkpoint_from_a_newer_release(tmp_path: Path) -> None:
    future = max(READ_VERSIONS) + 1
    checkpoint = tmp_path / "plugins" / DRIVER / FILE_NAME
    checkpoint.parent.mkdir(parents=True)
    raw = json.dumps({"version": future, "claims": {"u1": {"state": "Carved"}}}).encode()
    checkpoint.write_bytes(raw)

    p = PluginProcess(tmp_path, "node-x", unreachable_kubeconfig(tmp_path / "kc"))
    try:
        rc = p.proc.wait(timeout=60)
    finally:
        p.stop()
    logs = p.logs()
    assert rc == 1, logs[-3000:]
    lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
    errors = [x for x in lines if x["level"] == "error"]
    (refusal,) = errors
    assert refusal["checkpoint"] == str(checkpoint) and refusal["versionFound"] == future
    msg = refusal["msg"]
    assert f"checkpoint {checkpoint} has format version {future}" in msg
    assert "reads only version(s) 1" in msg and "Refusing to start" in msg
    assert "exc" not in refusal  # the message, not a traceback
    assert "carve kubelet plugin running" not in logs
    assert not list(p.registry.glob("*.sock"))  # never served the kubelet
    assert checkpoint.read_bytes() == raw  # left for the release that can read it
    # nothing beside it but the agent's lock (kubeletplugin.agentlock), taken before reading
    assert sorted(x.name for x in checkpoint.parent.iterdir()) == [LOCK_FILE, FILE_NAME]
