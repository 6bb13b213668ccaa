"""A node-agent process for the crash tests: start (reconcile), run one operation, print JSON.

Run as `python -m tests.kubeletplugin.crash_worker ROOT OP UID...` with CARVE_SIM_CONFIG set.
Claims live in ROOT/claims.json (so finalizers survive the process, as they would in the API).
The environment variable CRASH_AT kills the process with SIGKILL at a non-NVML step:
`cdi-write` (right after the spec is on disk), `cdi-remove` (right after it is removed),
`save:<n>` (right after the n-th checkpoint write of this process). NVML steps are killed by
the simulator's own faults (CARVE_SIM_FAULT_TAG=worker). WARM_TTL (seconds) turns warm
slices on; WARM_SEED=<gpu minor>:<profile id> stands for the demand an earlier life of the
process saw there (the prediction is in memory, so a fresh process has none).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from driver.cdi import CdiWriter
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from kubeletplugin.checkpoint import Checkpoint, CheckpointStore
from kubeletplugin.claims import ClaimGoneError, ClaimSnapshot, parse_claim
from kubeletplugin.ports import ClaimRef
from kubeletplugin.prepare import Preparer, PreparerSettings
from kubeletplugin.warm import WarmSettings

_REPO = Path(__file__).resolve().parents[2]

DRIVER = "mig.carve.dev"
NODE = "node-a"


class FileClaims:
    """ClaimClient over a JSON file guarded by flock (shared by test and worker processes)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
            yield data
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)

    def put(self, obj: dict[str, Any]) -> None:
        with self._locked() as data:
            data[f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"] = obj

    def raw(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._locked() as data:
            obj: dict[str, Any] | None = data.get(f"{namespace}/{name}")
            return obj

    def get(self, namespace: str, name: str) -> ClaimSnapshot | None:
        obj = self.raw(namespace, name)
        return None if obj is None else parse_claim(obj)

    def add_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        with self._locked() as data:
            obj = data.get(f"{namespace}/{name}")
            if obj is None or obj["metadata"]["uid"] != uid:
                raise ClaimGoneError(f"{namespace}/{name} gone")
            fins = obj["metadata"].setdefault("finalizers", [])
            if finalizer not in fins:
                fins.append(finalizer)

    def remove_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        with self._locked() as data:
            obj = data.get(f"{namespace}/{name}")
            if obj is None or obj["metadata"]["uid"] != uid:
                return
            fins = obj["metadata"].get("finalizers") or []
            if finalizer in fins:
                fins.remove(finalizer)

    def apply_device_status(
        self, namespace: str, name: str, uid: str, manager: str, entries: Sequence[Any]
    ) -> None:
        with self._locked() as data:
            obj = data.get(f"{namespace}/{name}")
            if obj is not None and obj["metadata"]["uid"] == uid:
                obj.setdefault("status", {})["devices"] = list(entries)

    def holding(self, finalizer: str) -> list[ClaimSnapshot]:
        with self._locked() as data:
            return [
                parse_claim(o)
                for o in data.values()
                if finalizer in (o["metadata"].get("finalizers") or ())
            ]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_crash_hooks(crash_at: str) -> None:
    if crash_at in ("finalizer-add", "finalizer-remove"):
        # Killed right after the apiserver applied the finalizer change, before the plugin
        # could save that it did: as a lost answer or a crash between the PATCH and the save.
        name = crash_at.replace("finalizer-", "") + "_finalizer"
        original = getattr(FileClaims, name)

        def change(self: FileClaims, *a: Any) -> None:
            original(self, *a)
            _kill()

        setattr(FileClaims, name, change)
    elif crash_at == "cdi-write":
        original_write = CdiWriter.write

        def write(self: CdiWriter, *a: Any, **k: Any) -> tuple[str, ...]:
            original_write(self, *a, **k)
            _kill()
            raise AssertionError("unreachable")

        CdiWriter.write = write  # type: ignore[method-assign]
    elif crash_at == "cdi-remove":
        original_remove = CdiWriter.remove

        def remove(self: CdiWriter, uid: str) -> bool:
            removed = original_remove(self, uid)
            if removed:
                _kill()
            return removed

        CdiWriter.remove = remove  # type: ignore[method-assign]
    elif crash_at.startswith("save:"):
        target = int(crash_at.split(":")[1])
        original_save = CheckpointStore.save
        count = [0]

        def save(self: CheckpointStore, cp: Checkpoint) -> None:
            original_save(self, cp)
            count[0] += 1
            if count[0] == target:
                _kill()

        CheckpointStore.save = save  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    root, op, *uids = argv
    rootp = Path(root)
    claims = FileClaims(rootp / "claims.json")
    sim.configure(None)  # from CARVE_SIM_CONFIG
    backend = NvmlBackend(sim, proc_root=sim.sim_proc_root()).open()
    preparer = Preparer(
        settings=PreparerSettings(
            DRIVER, NODE, NODE, warm=WarmSettings(float(os.environ.get("WARM_TTL") or 0))
        ),
        backend=backend,
        claims=claims,
        store=CheckpointStore(rootp / "checkpoint"),
        cdi=CdiWriter(rootp / "cdi", vendor=DRIVER),
    )
    if os.environ.get("WARM_SEED"):
        minor, profile = (int(x) for x in os.environ["WARM_SEED"].split(":"))
        gpu = next(g.uuid for g in backend.gpus() if g.minor == minor)
        for _ in range(2):
            preparer.warm.demand.record(gpu, profile, time.time())
    preparer.reconcile()
    crash_at = os.environ.get("CRASH_AT", "")
    if crash_at:
        _install_crash_hooks(crash_at)
    refs = []
    for uid in uids:
        obj = next(
            o for o in json.loads((rootp / "claims.json").read_text()).values()
            if o["metadata"]["uid"] == uid
        )  # fmt: skip
        refs.append(ClaimRef(obj["metadata"]["namespace"], obj["metadata"]["name"], uid))
    out: dict[str, Any]
    if op == "prepare":
        res = preparer.prepare(refs)
        out = {
            uid: {"error": r.error, "cdi": [list(d.cdi_device_ids) for d in r.devices]}
            for uid, r in res.items()
        }
    elif op == "unprepare":
        out = {uid: {"error": e} for uid, e in preparer.unprepare(refs).items()}
    else:
        out = {}
    preparer.close()
    backend.close()
    print(json.dumps(out))
    return 0


def run_worker(
    config: Path, root: Path, op: str, uid: str, crash_at: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run this worker for one operation on claim `uid`, as the crash tests do: the
    simulator's faults tagged `worker`, and CRASH_AT for the non-NVML crash points."""
    env = {
        **os.environ,
        "CARVE_SIM_CONFIG": str(config),
        "CARVE_SIM_FAULT_TAG": "worker",
        "CRASH_AT": crash_at,
        "PYTHONPATH": str(_REPO),
    }
    return subprocess.run(
        [sys.executable, "-m", "tests.kubeletplugin.crash_worker", str(root), op, uid],
        env=env, cwd=_REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
