"""``python -m nodesim gpu NODE INDEX hang|answer|fail ERROR``: make one of the running demo's
simulated GPUs sick, and well again, to see what an operator would see (issue 45).

The demo's nodes run carve's plugin on the NVML simulator, whose state (faults included) lives
in a file that every process on the node shares; this writes a fault there, the way the tests
do (``driver.nvml.sim.sim_inject_fault``). The plugin's next look at its GPUs (every 5 s)
meets it:

- ``hang``: that GPU's next NVML call never returns, as on a GPU whose driver is wedged. After
  the plugin's NVML deadline (``--nvml-timeout``, 20 s) the GPU is *unresponsive*: its devices
  are tainted, the Node gets a ``GpuUnresponsive`` event, ``carve status`` shows the taint.
- ``fail ERROR``: that GPU's NVML calls answer ``ERROR`` (``UNKNOWN``, ``GPU_IS_LOST``, ...)
  until ``answer``; the GPU is failing (or lost) and left out.
- ``answer``: the held call returns and the faults on that GPU are disarmed; the plugin says
  ``GpuBack`` and finishes what the fault interrupted.

Dev tooling: nothing here ships with carve.
"""

from __future__ import annotations

from pathlib import Path

# The call the plugin's GPU watch makes on every GPU at every look (driver.nvml.backend
# `_read_gpu` reads each UUID), so a fault there is met within one look whatever else the node does.
WATCHED_CALL = "DeviceGetUUID"
# A failing GPU fails every look until `answer`: more than a demo ever makes.
_FAIL_TIMES = 1_000_000
ACTIONS = ("hang", "answer", "fail")


class GpuFaultError(RuntimeError):
    """The demo is not running, or has no such node or GPU; the message says which."""


def sim_config_of(root: Path, node: str) -> Path:
    """The running demo's simulator config for ``node`` (from the node host's record)."""
    from nodesim.demo import host_info

    info = host_info(root)
    if not info:
        raise GpuFaultError(f"no demo is running under {root}: start one with `make demo`")
    nodes = info.get("nodes") or {}
    if node not in nodes:
        known = ", ".join(sorted(nodes)) or "none yet"
        raise GpuFaultError(f"the demo has no node {node!r} (its nodes: {known})")
    config = Path(nodes[node]) / "sim.yaml"
    if not config.exists():
        raise GpuFaultError(f"node {node!r} has no simulator config at {config}")
    return config


def apply(root: Path, node: str, gpu: int, action: str, error: str | None = None) -> str:
    """Apply ``action`` to GPU ``gpu`` of ``node``; returns what was done, for the user."""
    from driver.nvml import sim

    if action not in ACTIONS:
        raise GpuFaultError(f"unknown action {action!r}: use one of {', '.join(ACTIONS)}")
    if action == "fail" and not error:
        raise GpuFaultError("`fail` needs an NVML error, e.g. UNKNOWN or GPU_IS_LOST")
    sim.configure(sim_config_of(root, node))
    try:
        count = len(sim.sim_config().gpus)
        if not 0 <= gpu < count:
            raise GpuFaultError(f"node {node!r} has GPUs 0..{count - 1}, not {gpu}")
        if action == "hang":
            sim.sim_inject_fault(WATCHED_CALL, hang=True, gpu=gpu)
            return (
                f"{node} GPU {gpu}: its next NVML call hangs; within the plugin's NVML "
                "deadline (20 s) plus one look (5 s) it is unresponsive. Watch: "
                f"kubectl describe node {node}; carve status"
            )
        if action == "fail":
            sim.sim_inject_fault(WATCHED_CALL, error=error, gpu=gpu, times=_FAIL_TIMES)
            return f"{node} GPU {gpu}: NVML answers {error} for it until `answer`"
        released = len([h for h in sim.sim_hung_calls() if h.get("gpu") == gpu])
        sim.sim_clear_faults(gpu=gpu)
        return f"{node} GPU {gpu}: answers again ({released} held call(s) released)"
    except sim.SimConfigError as e:
        raise GpuFaultError(str(e)) from None
    finally:
        sim.configure(None)
