"""A separate process driving the backend on the simulator named by CARVE_SIM_CONFIG.

Usage: python -m tests.driver.nvml.sim_worker list
       python -m tests.driver.nvml.sim_worker carve <gpu-index> <profile-id> <start>
       python -m tests.driver.nvml.sim_worker destroy <gpu-index> <gi-id>
Prints one JSON document on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from driver.nvml import sim
from driver.nvml.backend import NvmlBackend


def main(argv: list[str]) -> int:
    with NvmlBackend(sim) as backend:
        gpus = backend.gpus()
        if argv[0] == "list":
            out = {g.uuid: [dataclasses.asdict(i) for i in backend.instances(g.uuid)] for g in gpus}
        elif argv[0] == "carve":
            gpu, profile_id, start = (int(x) for x in argv[1:4])
            out = dataclasses.asdict(backend.carve(gpus[gpu].uuid, profile_id, start))
        elif argv[0] == "destroy":
            gpu, gi_id = int(argv[1]), int(argv[2])
            backend.destroy(gpus[gpu].uuid, gi_id)
            out = {"destroyed": gi_id}
        else:
            raise SystemExit(f"unknown command {argv[0]!r}")
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
