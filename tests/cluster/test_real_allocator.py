"""kube-scheduler's structured allocator (dra-allocate, the v0.37.2 library) on carve's slices.

The devices carve publishes must make the real allocator obey MIG geometry: for every claim it
allocates exactly when ``driver.geometry`` says some placement of the profile still fits, and
what it picks can be created next to what it picked before. Marked ``cluster``: dra-allocate is
built by hack/k8s/build.sh with the control plane.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from devcluster.cluster import LocalCluster
from devcluster.waiting import wait_for
from driver.catalog import GpuModel, gpu_model
from driver.geometry import EMPTY_STATE, GpuState, geometry_for
from driver.naming import parse_device_name
from tests.cluster.dra_objects import Api, allocated_devices, pod, pod_condition, unique_driver
from tests.support.real_allocator import (
    allocate,
    binary,
    device_classes,
    node_slices,
    profile_claim,
    release,
    run_steps,
)

pytestmark = pytest.mark.cluster

A100 = gpu_model("A100-SXM4-40GB")


@pytest.fixture(scope="module")
def exe(k8s_cluster: LocalCluster) -> Path:
    """dra-allocate is built with the control plane, so the cluster fixture's policy (skip
    without Go, fail where CARVE_REQUIRE_CLUSTER is set) covers it too."""
    return binary(build=False)


def _placement(device: str) -> tuple[int, int]:
    parsed = parse_device_name(device)
    assert parsed.profile_id is not None and parsed.placement_start is not None, device
    return parsed.profile_id, parsed.placement_start


def test_seven_1g_fit_an_empty_a100_and_an_eighth_does_not(exe: Path) -> None:
    steps = [allocate(profile_claim(f"small-{i}", "1g.5gb")) for i in range(8)]
    verdicts = run_steps(node_slices([A100]), steps, exe=exe)
    assert [v.status for v in verdicts] == ["allocated"] * 7 + ["unschedulable"]
    chosen = [v.devices[0] for v in verdicts[:7]]
    assert len(set(chosen)) == 7
    # The seven placements coexist on a real A100 (geometry rebuilds them without error).
    geometry_for(A100).state_of(_placement(d) for d in chosen)


def test_3g_after_four_1g_follows_geometry(exe: Path) -> None:
    steps = [allocate(profile_claim(f"small-{i}", "1g.5gb")) for i in range(4)]
    steps += [allocate(profile_claim("big", "3g.20gb"))]
    verdicts = run_steps(node_slices([A100]), steps, exe=exe)
    assert [v.status for v in verdicts[:4]] == ["allocated"] * 4
    geometry = geometry_for(A100)
    state = geometry.state_of(_placement(v.devices[0]) for v in verdicts[:4])
    big = next(p for p in A100.profiles if p.name == "3g.20gb")
    fits = bool(geometry.feasible_starts(state, big.id))
    assert verdicts[4].allocated == fits, (state.instances, verdicts[4])


def _trace(model: GpuModel, seed: int, length: int) -> Iterator[tuple[str, str | None]]:
    """(claim name, profile) to allocate, or (claim name, None) to release a held one."""
    rng = random.Random(seed)
    names = [p.name for p in model.profiles]
    held: list[str] = []
    for i in range(length):
        if held and rng.random() < 0.35:
            yield held.pop(rng.randrange(len(held))), None
        else:
            name = f"c{i}"
            held.append(name)
            yield name, rng.choice(names)


@pytest.mark.parametrize(
    ("model_key", "seed"),
    [
        ("A100-SXM4-40GB", 1),
        ("A100-SXM4-40GB", 2),
        ("H100-SXM5-80GB", 3),
        ("A30-24GB", 4),
        ("B200-180GB", 5),
    ],
)
def test_allocator_agrees_with_geometry_on_a_random_trace(
    exe: Path, model_key: str, seed: int
) -> None:
    model = gpu_model(model_key)
    trace = list(_trace(model, seed, 60))
    steps = [
        allocate(profile_claim(name, profile)) if profile else release(name)
        for name, profile in trace
    ]
    verdicts = run_steps(node_slices([model]), steps, exe=exe)
    assert len(verdicts) == len(steps)
    geometry = geometry_for(model)
    by_name = {p.name: p for p in model.profiles}
    state: GpuState = EMPTY_STATE
    held: dict[str, tuple[int, int]] = {}
    allocated = 0
    for (name, profile), v in zip(trace, verdicts, strict=True):
        if profile is None:
            if name in held:
                assert v.status == "released", v
                state = geometry.remove(state, *held.pop(name))
            continue
        spec = by_name[profile]
        expect = bool(geometry.feasible_starts(state, spec.id))
        assert v.status == ("allocated" if expect else "unschedulable"), (state.instances, v)
        if v.allocated:
            allocated += 1
            pid, start = _placement(v.devices[0])
            assert pid == spec.id, v
            state = geometry.place(state, pid, start)  # raises if geometry forbids it
            held[name] = (pid, start)
    assert allocated >= 3  # the trace exercised the allocator, not just refusals


def _pod_outcome(api: Api, namespace: str, pod_name: str) -> str | None:
    """'bound', 'unschedulable', or None while the scheduler has not decided."""
    obj = api.read_pod(namespace, pod_name)
    if obj.get("spec", {}).get("nodeName"):
        return "bound"
    cond = pod_condition(obj, "PodScheduled")
    if cond and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
        return "unschedulable"
    return None


def test_kube_scheduler_picks_what_dra_allocate_picks(
    exe: Path, k8s_api: ApiClient, namespace: str, fake_node: Any
) -> None:
    """The same slices and claims, one pod at a time, through the devcluster's kube-scheduler:
    the same verdicts and the same devices as dra-allocate (run with the scheduler's gates)."""
    api = Api(k8s_api)
    driver = unique_driver()
    node = fake_node()
    prefix = driver.split(".")[0]
    mig_class, gpu_class = f"{prefix}-mig", f"{prefix}-gpu"
    slices = node_slices([A100], node=node, driver=driver)
    classes = device_classes(driver, mig_class=mig_class, gpu_class=gpu_class)
    profiles = ["1g.5gb"] * 4 + ["3g.20gb", "2g.10gb", "1g.10gb", "1g.5gb"]
    claims = [
        profile_claim(f"c{i}", p, driver=driver, device_class=mig_class, namespace=namespace)
        for i, p in enumerate(profiles)
    ]
    expected = run_steps(slices, [allocate(c) for c in claims], node=node, classes=classes)

    for c in classes:
        api.resource.create_device_class(client.V1DeviceClass.model_validate(c))
    try:
        for s in slices:
            api.resource.create_resource_slice(client.V1ResourceSlice.model_validate(s))
        for claim, want in zip(claims, expected, strict=True):
            name = claim["metadata"]["name"]
            api.resource.create_namespaced_resource_claim(
                namespace, client.ResourceV1ResourceClaim.model_validate(claim)
            )
            api.create_pod(namespace, pod(name, claim=name))
            outcome = wait_for(
                f"kube-scheduler to decide on {name}",
                functools.partial(_pod_outcome, api, namespace, name),
            )
            got = allocated_devices(api.read_claim(namespace, name))
            assert (outcome, got) == (
                "bound" if want.allocated else "unschedulable",
                list(want.devices),
            ), (name, want)
            if outcome == "unschedulable":
                # Not allocated, holds nothing; remove it so it is not retried during later steps.
                api.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
                api.resource.delete_namespaced_resource_claim(name, namespace)
        assert [v.status for v in expected].count("unschedulable") >= 1  # a refusal was compared
    finally:
        api.resource.delete_collection_resource_slice(field_selector=f"spec.driver={driver}")
        for c in classes:
            api.resource.delete_device_class(c["metadata"]["name"])
