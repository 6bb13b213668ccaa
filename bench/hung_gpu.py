"""Prepare latency on a node's healthy GPU while another GPU of the node hangs in NVML.

Run: python -m bench.hung_gpu [--rounds 20] [--timeout 2] [--retriers 8]

One simulated node with an H100 (GPU 0) and an A100 (GPU 1), realistic simulator latencies,
the real Preparer (only the claim API is in memory, as in bench.prepare_latency). Two arms in
the same run:
  * no hang: claims on the A100 are prepared and unprepared one after another;
  * hung H100: the same, while a carve on the H100 hangs in NVML (the simulator's hang fault,
    never released during the arm) and `--retriers` threads play the kubelet retrying prepares
    of claims on the H100 once a second, as it does for pods stuck there.
Printed: prepare and unprepare p50/p99 on the A100 in each arm, their ratio (target: within
2x, issue 45), and how long the H100's retries waited for their answer.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.prepare_latency import DRIVER, NODE, MemoryClaims, _pct, _timed
from driver.cdi import CdiWriter
from driver.naming import mig_device_name
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.prepare import Preparer, PreparerSettings


def _arm(
    root: Path, *, hang: bool, rounds: int, timeout: float, retriers: int
) -> dict[str, list[float]]:
    sim.configure(
        {
            "state": str(root / "state.json"),
            "gpus": ["H100-SXM5-80GB", "A100-SXM4-40GB"],
            "options": {"latency": "realistic"},
        }
    )
    backend = NvmlBackend(sim, proc_root=sim.sim_proc_root(), timeout=timeout).open()
    claims = MemoryClaims()
    preparer = Preparer(
        settings=PreparerSettings(DRIVER, NODE, NODE),  # the plugin's own prepare workers
        backend=backend,
        claims=claims,
        store=CheckpointStore(root / "checkpoint"),
        cdi=CdiWriter(root / "cdi", vendor=DRIVER),
    )
    preparer.reconcile()
    out: dict[str, list[float]] = {"prepare": [], "unprepare": [], "retry": []}
    stop = threading.Event()

    def kubelet_retrying(i: int) -> None:
        ref = claims.add(f"stuck-{i}", mig_device_name(0, "1g.10gb", 19, i % 7))
        while not stop.is_set():
            out["retry"].append(_timed(lambda: preparer.prepare([ref])))
            stop.wait(1.0)

    threads: list[threading.Thread] = []
    if hang:
        sim.sim_inject_fault("DeviceCreateGpuInstanceWithPlacement", hang=True, gpu=0, times=1000)
        threads = [threading.Thread(target=kubelet_retrying, args=(i,)) for i in range(retriers)]
        for t in threads:
            t.start()
        time.sleep(0.2)  # the first retry is in the hung carve
    for r in range(rounds):
        ref = claims.add(f"ok-{r}", mig_device_name(1, "1g.5gb", 19, r % 7))
        out["prepare"].append(_timed(lambda ref=ref: preparer.prepare([ref])))
        out["unprepare"].append(_timed(lambda ref=ref: preparer.unprepare([ref])))
    stop.set()
    for t in threads:
        t.join()
    sim.sim_release_hangs()
    preparer.close()
    backend.close()
    sim.configure(None)
    return out


def _line(label: str, values: Sequence[float]) -> str:
    return (
        f"  {label:<28} n={len(values):<4} p50={_pct(values, 0.5) * 1000:8.1f} ms  "
        f"p99={_pct(values, 0.99) * 1000:8.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=2.0, help="--nvml-timeout, seconds")
    ap.add_argument("--retriers", type=int, default=8)
    args = ap.parse_args()
    arms = {}
    for name, hang in (("no hang", False), ("hung H100", True)):
        with tempfile.TemporaryDirectory() as d:
            arms[name] = _arm(
                Path(d), hang=hang, rounds=args.rounds, timeout=args.timeout, retriers=args.retriers
            )
    print(
        f"A100 prepares with the H100 healthy vs hung (realistic latency, deadline "
        f"{args.timeout:g}s, {args.retriers} kubelet retriers on the H100)"
    )
    for name, got in arms.items():
        print(f"{name}:")
        print(_line("A100 prepare", got["prepare"]))
        print(_line("A100 unprepare", got["unprepare"]))
        if got["retry"]:
            print(_line("H100 retry answered in", got["retry"]))
    for op in ("prepare", "unprepare"):
        base, hung = arms["no hang"][op], arms["hung H100"][op]
        print(
            f"{op} on the A100, hung / no hang: p50 x{_pct(hung, 0.5) / _pct(base, 0.5):.2f}, "
            f"p99 x{_pct(hung, 0.99) / _pct(base, 0.99):.2f}"
        )


if __name__ == "__main__":
    main()
