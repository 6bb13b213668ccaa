"""Prepare/unprepare latency of the node agent on the NVML simulator.

Run: python -m bench.prepare_latency [--gpus 4] [--rounds 2] [--latency zero realistic]

For each simulated-latency setting it runs the real Preparer (backend on the simulator, real
checkpoint and CDI files; only the claim API is in memory) in two patterns:
  * sequential: one claim per call, one after another (the kubelet starting pods one by one);
  * concurrent: every claim in its own call at once (a burst of pods; claims on different
    GPUs carve in parallel, claims on one GPU queue on that GPU's lock).
Each claim asks for one 1g slice; a node of N H100s holds 7*N of them. Figures are printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from driver.cdi import CdiWriter
from driver.contract import DEFAULT_DRIVER_NAME
from driver.naming import mig_device_name
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import CheckpointStore
from kubeletplugin.claims import ClaimSnapshot, parse_claim
from kubeletplugin.ports import ClaimRef
from kubeletplugin.prepare import Preparer, PreparerSettings

DRIVER = DEFAULT_DRIVER_NAME
NODE = "bench-node"


class MemoryClaims:
    """Allocated claims held in memory (the apiserver is not what is measured here)."""

    def __init__(self) -> None:
        self._objs: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, device: str) -> ClaimRef:
        uid = str(uuid.uuid4())
        result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
        with self._lock:
            self._objs[("bench", name)] = {
                "metadata": {"namespace": "bench", "name": name, "uid": uid, "finalizers": []},
                "status": {"allocation": {"devices": {"results": [result]}}},
            }
        return ClaimRef("bench", name, uid)

    def get(self, namespace: str, name: str) -> ClaimSnapshot | None:
        with self._lock:
            obj = self._objs.get((namespace, name))
            return None if obj is None else parse_claim(obj)

    def add_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        with self._lock:
            self._objs[(namespace, name)]["metadata"]["finalizers"].append(finalizer)

    def remove_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        with self._lock:
            fins = self._objs[(namespace, name)]["metadata"]["finalizers"]
            if finalizer in fins:
                fins.remove(finalizer)

    def apply_device_status(
        self, namespace: str, name: str, uid: str, manager: str, entries: Sequence[Any]
    ) -> None:
        with self._lock:
            self._objs[(namespace, name)].setdefault("status", {})["devices"] = list(entries)

    def holding(self, finalizer: str) -> list[ClaimSnapshot]:
        with self._lock:
            return [
                parse_claim(o)
                for o in self._objs.values()
                if finalizer in o["metadata"]["finalizers"]
            ]


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _report(label: str, samples: Sequence[float]) -> None:
    print(
        f"  {label:<24} n={len(samples):<4} p50={_pct(samples, 0.5) * 1000:8.1f} ms  "
        f"p99={_pct(samples, 0.99) * 1000:8.1f} ms  mean={statistics.mean(samples) * 1000:8.1f} ms"
    )


def run(latency: str, gpus: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        sim.configure(
            {
                "state": str(root / "state.json"),
                "gpus": ["H100-SXM5-80GB"] * gpus,
                "options": {"latency": latency},
            }
        )
        backend = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()
        claims = MemoryClaims()
        preparer = Preparer(
            settings=PreparerSettings(DRIVER, NODE, NODE, parallelism=max(8, 7 * gpus)),
            backend=backend,
            claims=claims,
            store=CheckpointStore(root / "checkpoint"),
            cdi=CdiWriter(root / "cdi", vendor=DRIVER),
        )
        preparer.reconcile()
        devices = [mig_device_name(g, "1g.10gb", 19, s) for g in range(gpus) for s in range(7)]
        print(f"latency={latency}: {gpus} x H100, {len(devices)} one-slice claims per round")
        seq_p: list[float] = []
        seq_u: list[float] = []
        con_p: list[float] = []
        con_u: list[float] = []

        def one(refs: list[ClaimRef], op: str) -> float:
            fn = preparer.prepare if op == "prepare" else preparer.unprepare
            return _timed(lambda: fn(refs))

        for r in range(rounds):
            refs = [claims.add(f"s{r}-{i}", dev) for i, dev in enumerate(devices)]
            seq_p += [one([ref], "prepare") for ref in refs]
            seq_u += [one([ref], "unprepare") for ref in refs]
            refs = [claims.add(f"c{r}-{i}", dev) for i, dev in enumerate(devices)]
            with ThreadPoolExecutor(len(refs)) as pool:
                con_p += list(pool.map(lambda ref: one([ref], "prepare"), refs))
            with ThreadPoolExecutor(len(refs)) as pool:
                con_u += list(pool.map(lambda ref: one([ref], "unprepare"), refs))
        _report("prepare, sequential", seq_p)
        _report("unprepare, sequential", seq_u)
        _report("prepare, concurrent", con_p)
        _report("unprepare, concurrent", con_u)
        preparer.close()
        backend.close()
        sim.configure(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--latency", nargs="+", default=["zero", "realistic"])
    args = ap.parse_args()
    for latency in args.latency:
        run(latency, args.gpus, args.rounds)


if __name__ == "__main__":
    main()
