"""The end-to-end invariant checker finds overlaps and leaks, and only those."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from driver.allocation import AllocatedDevice
from driver.catalog import gpu_model
from driver.naming import mig_device_name
from nodesim.invariants import (
    HeldDevice,
    NodeHardware,
    Slot,
    allocated_devices,
    at_rest,
    leaks,
    node_hardware,
    overlaps,
)

A100 = gpu_model("A100-SXM4-40GB")
P1G = next(p for p in A100.profiles if p.name == "1g.5gb")
P3G = next(p for p in A100.profiles if p.name == "3g.20gb")


DRIVER = "mig.carve.dev"


def held(claim: str, node: str, device: str) -> HeldDevice:
    return HeldDevice(claim, AllocatedDevice("gpu", DRIVER, node, device))


def dev(claim: str, profile: Any, start: int, node: str = "n") -> HeldDevice:
    return held(claim, node, mig_device_name(0, profile.name, profile.id, start))


def hw(*slots: tuple[int, int]) -> dict[str, NodeHardware]:
    return {"n": NodeHardware("n", {0: A100}, tuple(Slot("n", 0, p, s) for p, s in slots))}


def test_overlap_is_found_on_shared_memory_slices() -> None:
    assert overlaps([dev("a", P3G, 0), dev("b", P3G, 4)], hw()) == []
    [problem] = overlaps([dev("a", P3G, 0), dev("b", P1G, 2)], hw())
    assert "memory slice 2" in problem and "a" in problem and "b" in problem
    [twice] = overlaps([dev("a", P1G, 0), dev("b", P1G, 0)], hw())
    assert "allocated to both" in twice


def test_whole_gpu_overlaps_everything() -> None:
    whole = held("w", "n", "gpu-0")
    assert overlaps([whole, dev("b", P1G, 6)], hw())


def test_leak_needs_both_snapshots_to_miss_the_instance() -> None:
    hardware = hw((P1G.id, 3))
    owned = [dev("a", P1G, 3)]
    assert leaks(hardware, owned, []) == []
    assert leaks(hardware, [], owned) == []
    [leak] = leaks(hardware, [], [dev("a", P1G, 4)])
    assert "placement start 3" in leak


def test_at_rest_is_one_to_one() -> None:
    assert at_rest(hw((P1G.id, 3)), [dev("a", P1G, 3)]) == []
    assert len(at_rest(hw((P1G.id, 3)), [])) == 1
    assert len(at_rest(hw(), [dev("a", P1G, 3)])) == 1


def test_an_instance_the_node_keeps_warm_is_neither_a_leak_nor_unclaimed() -> None:
    [node] = hw((P1G.id, 3), (P1G.id, 4)).values()
    warm = {"n": replace(node, warm=frozenset({Slot("n", 0, P1G.id, 4)}))}
    owned = [dev("a", P1G, 3)]
    assert leaks(warm, owned, owned) == []
    assert at_rest(warm, owned) == []
    assert len(leaks(hw((P1G.id, 3), (P1G.id, 4)), owned, owned)) == 1  # not warm: a leak
    # Warm means owned by the node, not allocated: a claim still needs its own instance.
    assert len(at_rest(warm, [*owned, dev("b", P1G, 4)])) == 1


def test_snapshots_are_read_from_simulator_state_and_claims() -> None:
    state = {"gpus": [{"minor": 0, "gis": [{"profile_id": P3G.id, "start": 4}]}]}
    view = node_hardware("n", [A100], state)
    assert view.instances == (Slot("n", 0, P3G.id, 4),)
    claim = {
        "metadata": {"namespace": "ns", "name": "c"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": "n",
                            "device": "gpu-0-mig-3g20gb-9-4",
                        },
                        {"request": "nic", "driver": "other", "pool": "n", "device": "x"},
                    ]
                }
            }
        },
    }
    assert allocated_devices([claim], DRIVER) == [held("ns/c", "n", "gpu-0-mig-3g20gb-9-4")]


@given(st.lists(st.sampled_from([(P1G, s) for s in P1G.starts] + [(P3G, s) for s in P3G.starts])))
def test_overlap_agrees_with_a_slice_count(picks: list[Any]) -> None:
    devices = [dev(f"c{i}", p, s) for i, (p, s) in enumerate(picks)]
    units: list[int] = []
    for p, s in picks:
        units += range(s, s + p.size)
    assert bool(overlaps(devices, hw())) == (len(units) != len(set(units)))
