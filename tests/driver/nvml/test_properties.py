"""Invariants of random create/destroy sequences through the backend on the simulator.

The simulator enforces MIG rules with its own code, and ``driver.geometry`` implements them
separately for the controller; these properties hold the two against each other and against
the invariants every GPU state must keep (no overlap, engine pools never exceeded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from driver.catalog import Engines, GpuModel, ProfileSpec
from driver.geometry import EMPTY_STATE, Geometry, GpuState, geometry_for
from driver.nvml import sim
from driver.nvml.backend import NvmlBackend
from driver.nvml.errors import PlacementTaken
from driver.nvml.types import GpuInstance

REPO = Path(__file__).resolve().parents[3]

MODELS = [
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "H100-SXM5-80GB",
    "H200-SXM5-141GB",
    "A30-24GB",
    "RTX-PRO-6000-Blackwell",
    "B200-180GB",
]

# An action: ("create", profile pick, placement pick) or ("destroy", instance pick).
actions = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.integers(0, 63), st.integers(0, 63)),
        st.tuples(st.just("destroy"), st.integers(0, 63), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


def _check_invariants(model: GpuModel, instances: tuple[GpuInstance, ...]) -> None:
    mask = 0
    engines = Engines(0, 0, 0, 0, 0)
    for inst in instances:
        assert not inst.placement.mask & mask, f"overlap at {inst.placement} in {instances}"
        mask |= inst.placement.mask
        engines = engines + model.profile_by_id(inst.profile_id).engines
        assert len(inst.ci_ids) == 1 and inst.mig_uuid is not None
    assert engines.fits_within(model.engine_totals), f"engine pools exceeded: {engines}"
    for profile in model.profiles:
        count = sum(1 for i in instances if i.profile_id == profile.id)
        assert count <= profile.max_instances


@cache
def _max_more(geometry: Geometry, state: GpuState, profile_id: int) -> int:
    """Brute force: the most further instances of the profile that can coexist."""
    best = 0
    for start in geometry.feasible_starts(state, profile_id):
        best = max(
            best, 1 + _max_more(geometry, geometry.place(state, profile_id, start), profile_id)
        )
    return best


def _pick(profiles: tuple[ProfileSpec, ...], i: int) -> ProfileSpec:
    return profiles[i % len(profiles)]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(key=st.sampled_from(MODELS), steps=actions)
def test_random_sequences_keep_invariants_and_agree_with_geometry(
    key: str, steps: list[tuple[str, int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sim.configure({"state": str(Path(tmp) / "state.json"), "gpus": [key]})
        with NvmlBackend(sim) as backend:
            gpu = backend.gpus()[0]
            model = backend.gpu_model(gpu.uuid)
            geometry = geometry_for(model)
            state = EMPTY_STATE
            for op, a, b in steps:
                live = backend.instances(gpu.uuid)
                if op == "create":
                    profile = _pick(model.profiles, a)
                    start = profile.placements[b % len(profile.placements)].start
                    expect_fit = geometry.fits(state, profile.id, start)
                    try:
                        carved = backend.carve(gpu.uuid, profile.id, start)
                    except PlacementTaken:
                        assert not expect_fit, f"geometry says {profile.name}@{start} fits"
                    else:
                        assert expect_fit, f"simulator created {profile.name}@{start}"
                        assert carved.placement.start == start
                        state = geometry.place(state, profile.id, start)
                elif live:
                    victim = live[a % len(live)]
                    backend.destroy(gpu.uuid, victim.gi_id)
                    state = geometry.remove(state, victim.profile_id, victim.placement.start)
                live = backend.instances(gpu.uuid)
                _check_invariants(model, live)
                assert geometry.state_of((i.profile_id, i.placement.start) for i in live) == state
                for profile in model.profiles:
                    nvml_says = backend.remaining_capacity(gpu.uuid, profile.id)
                    assert nvml_says == geometry.remaining_capacity(state, profile.id), (
                        f"{profile.name}: simulator {nvml_says}, geometry "
                        f"{geometry.remaining_capacity(state, profile.id)}"
                    )
                    assert nvml_says == _max_more(geometry, state, profile.id)
        sim.configure(None)


@settings(max_examples=25, deadline=None)
@given(key=st.sampled_from(MODELS), picks=st.lists(st.integers(0, 63), min_size=1, max_size=10))
def test_auto_placement_only_fails_when_no_placement_is_free(key: str, picks: list[int]) -> None:
    """nvmlDeviceCreateGpuInstance (no placement) succeeds exactly when geometry has a
    feasible start, and lands on one of them."""
    with tempfile.TemporaryDirectory() as tmp:
        sim.configure({"state": str(Path(tmp) / "state.json"), "gpus": [key]})
        sim.nvmlInit()
        try:
            with NvmlBackend(sim) as backend:
                gpu = backend.gpus()[0]
                model = backend.gpu_model(gpu.uuid)
                geometry = geometry_for(model)
                dev = sim.nvmlDeviceGetHandleByIndex(0)
                state = EMPTY_STATE
                for pick in picks:
                    profile = _pick(model.profiles, pick)
                    feasible = geometry.feasible_starts(state, profile.id)
                    try:
                        gi = sim.nvmlDeviceCreateGpuInstance(dev, profile.id)
                    except sim.NVMLError as exc:
                        assert exc.value == sim.NVML_ERROR_INSUFFICIENT_RESOURCES
                        assert feasible == ()
                        continue
                    start = sim.nvmlGpuInstanceGetInfo(gi).placement.start
                    assert start in feasible
                    state = geometry.place(state, profile.id, start)
        finally:
            sim.nvmlShutdown()
            sim.configure(None)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(MODELS), steps=actions)
def test_a_second_process_sees_the_same_instances_after_random_sequences(
    key: str, steps: list[tuple[str, int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = sim.sim_write_config(Path(tmp) / "sim.yaml", {"state": "s.json", "gpus": [key]})
        sim.configure(config)
        with NvmlBackend(sim) as backend:
            gpu = backend.gpus()[0]
            for op, a, b in steps:
                live = backend.instances(gpu.uuid)
                if op == "create":
                    profile = _pick(gpu.profiles, a)
                    start = profile.placements[b % len(profile.placements)].start
                    with contextlib.suppress(PlacementTaken):
                        backend.carve(gpu.uuid, profile.id, start)
                elif live:
                    backend.destroy(gpu.uuid, live[a % len(live)].gi_id)
            mine = {gpu.uuid: [dataclasses.asdict(i) for i in backend.instances(gpu.uuid)]}
        sim.configure(None)
        other = subprocess.run(
            [sys.executable, "-m", "tests.driver.nvml.sim_worker", "list"],
            cwd=REPO,
            env={**os.environ, "CARVE_SIM_CONFIG": str(config), "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(other.stdout) == json.loads(json.dumps(mine))
