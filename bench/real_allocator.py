"""The real baseline: kube-scheduler's structured allocator on carve's published devices.

    python -m bench.real_allocator                                  # fill table, every model
    python -m bench.real_allocator --model A100-SXM4-40GB 1g.5gb 1g.5gb 3g.20gb release:0 3g.20gb

NVIDIA DynamicMIG users get ``k8s.io/dynamic-resource-allocation/structured`` (v0.37.2, as
kube-scheduler v1.37.2 runs it) over partitionable devices. ``hack/k8s/cmd/dra-allocate`` runs
that library; this wrapper feeds it carve's own ResourceSlices (``build_resource_slices``) for
one node and prints, per step, the device the library picked and whether ``driver.geometry``
agrees a placement was possible. Without a sequence it prints, per model and profile, how many
claims of that profile the library fits on an empty GPU one at a time, next to the profile's
maximum instance count.

The input building and process handling are in tests.support.real_allocator (tests may not
import bench; bench may import tests.support).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from driver.catalog import CATALOG, GpuModel, gpu_model
from driver.geometry import EMPTY_STATE, geometry_for
from driver.naming import parse_device_name
from tests.support.real_allocator import (
    allocate,
    node_slices,
    profile_claim,
    release,
    run_steps,
)


def _steps(args: Sequence[str]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    for i, arg in enumerate(args):
        if arg.startswith("release:"):
            steps.append(release(f"c{int(arg.split(':', 1)[1])}"))
        else:
            steps.append(allocate(profile_claim(f"c{i}", arg)))
    return steps


def sequence(model: GpuModel, args: Sequence[str]) -> None:
    geometry = geometry_for(model)
    by_name = {p.name: p for p in model.profiles}
    state = EMPTY_STATE
    held: dict[str, tuple[int, int]] = {}
    for arg, v in zip(args, run_steps(node_slices([model]), _steps(args)), strict=True):
        if v.op == "release":
            if v.claim in held:
                state = geometry.remove(state, *held.pop(v.claim))
            print(f"{v.claim:>5} release   {v.status}")
            continue
        spec = by_name[arg]
        fits = bool(geometry.feasible_starts(state, spec.id))
        line = f"{v.claim:>5} {arg:<12} {v.status:<13}"
        if v.allocated:
            parsed = parse_device_name(v.devices[0])
            assert parsed.profile_id is not None and parsed.placement_start is not None
            key = (parsed.profile_id, parsed.placement_start)
            state = geometry.place(state, *key)
            held[v.claim] = key
            line += f" {v.devices[0]}"
        elif v.status != "unschedulable":
            line += f" {v.message}"
        agree = "agrees" if v.allocated == fits else "DISAGREES"
        print(f"{line}  (geometry: {'fits' if fits else 'full'}, {agree})")


def fill_table(models: Sequence[GpuModel]) -> None:
    print(f"{'model':<24} {'profile':<14} {'fitted':>6} {'max':>4}")
    for model in models:
        slices = node_slices([model])
        for spec in model.profiles:
            n = spec.max_instances + 1
            steps = [allocate(profile_claim(f"c{i}", spec.name)) for i in range(n)]
            fitted = sum(v.allocated for v in run_steps(slices, steps))
            print(f"{model.key:<24} {spec.name:<14} {fitted:>6} {spec.max_instances:>4}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", help="GPU model key (default: every catalogued model)")
    parser.add_argument("steps", nargs="*", help="profile names to claim, or release:<step index>")
    args = parser.parse_args(argv)
    if args.steps:
        sequence(gpu_model(args.model or "A100-SXM4-40GB"), args.steps)
    else:
        fill_table([gpu_model(args.model)] if args.model else list(CATALOG.values()))


if __name__ == "__main__":
    main()
