"""Slice utilization/fragmentation gauges and controller metrics (flags: test_main.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import generate_latest

from controller.metrics import ControllerMetrics, slice_usage
from controller.objects import Kind
from driver.apiobject import Obj
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices

DRIVER = "mig.carve.dev"


def _slices(node: str, n_gpus: int) -> list[Obj]:
    gpus = [
        PublishedGpu(
            i, f"GPU-{node}-{i}", gpu_model("A100-SXM4-40GB"), f"0000:0{i}:00.0", "580.1.1"
        )
        for i in range(n_gpus)
    ]
    return build_resource_slices(driver=DRIVER, node_name=node, pool_generation=1, gpus=gpus)


def _claim(*devices: tuple[str, str]) -> Obj:
    return {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "r", "driver": DRIVER, "pool": p, "device": d}
                        for p, d in devices
                    ]
                }
            }
        }
    }


def test_empty_cluster_is_fully_free_and_unfragmented() -> None:
    u = slice_usage(_slices("n1", 2), [], DRIVER)
    assert (u.gpus, u.total, u.used) == (2, 16, 0)  # A100-40GB: 8 memory slices per GPU
    assert u.utilization == 0.0
    assert u.fragmentation == 0.0


def test_a_slice_in_the_middle_fragments_the_gpu() -> None:
    # 1g.5gb at placement 3 leaves free runs {0,1,2} and {4..7}: largest 4 of 7 free.
    u = slice_usage(_slices("n1", 1), [_claim(("n1", "gpu-0-mig-1g5gb-19-3"))], DRIVER)
    assert u.used == 1
    assert u.utilization == pytest.approx(1 / 8)
    assert u.fragmentation == pytest.approx(1 - 4 / 7)


def test_packed_at_the_edge_is_not_fragmented_and_other_drivers_are_ignored() -> None:
    claims = [
        _claim(("n1", "gpu-0-mig-3g20gb-9-4")),
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "r",
                                "driver": "other.example.com",
                                "pool": "n1",
                                "device": "x",
                            }
                        ]
                    }
                }
            }
        },
    ]
    u = slice_usage(_slices("n1", 1), claims, DRIVER)
    assert u.used == 4
    assert u.fragmentation == 0.0


def test_metrics_are_exported() -> None:
    m = ControllerMetrics()
    m.observe_allocation(0.2, ["1g.5gb", "1g.5gb", "3g.20gb"])
    m.set_queue_depth(3)
    m.count_outcome("allocated")
    stores = {k: {} for k in Kind}
    stores[Kind.SLICE] = {str(i): s for i, s in enumerate(_slices("n1", 1))}
    stores[Kind.CLAIM] = {"c": _claim(("n1", "gpu-0-mig-1g5gb-19-3"))}
    m.update_usage(stores, DRIVER)
    text = generate_latest(m.registry).decode()
    assert 'carve_allocations_total{profile="1g.5gb"} 2.0' in text
    assert "carve_pending_pods 3.0" in text
    assert "carve_allocation_latency_seconds_count 1.0" in text
    assert "carve_slice_utilization_ratio 0.125" in text
    assert 'carve_placement_outcomes_total{outcome="allocated"} 1.0' in text


def test_a_decision_is_timed_in_wall_and_thread_cpu_time() -> None:
    """A planner that waits (as a thread does for the CPU or the GIL) shows in the wall-time
    histogram and not in the CPU one: the two tell a busy machine from a slow engine."""
    from tests.support.reconciler import Harness, claim, pod

    m = ControllerMetrics()
    h = Harness(metrics=m)
    plan = h.planner.plan

    def waiting_plan(*args: Any) -> Any:
        time.sleep(0.03)
        return plan(*args)

    h.planner.plan = waiting_plan  # type: ignore[method-assign]
    h.add(Kind.CLAIM, claim("c1"))
    h.add(Kind.POD, pod("p1", ["c1"]))
    h.step()
    assert h.planner.plans == 1
    text = generate_latest(m.registry).decode()
    assert "carve_decision_seconds_count 1.0" in text
    assert "carve_decision_cpu_seconds_count 1.0" in text
    assert 'carve_decision_seconds_bucket{le="0.025"} 0.0' in text  # waited 30 ms
    assert 'carve_decision_cpu_seconds_bucket{le="0.025"} 1.0' in text  # and spent little


def test_usage_index_agrees_with_a_full_read_and_sees_a_new_version() -> None:
    from controller.metrics import SliceUsageIndex

    store: dict[str, Obj] = {}
    for s in _slices("n1", 2) + _slices("n2", 1):
        s["metadata"]["resourceVersion"] = "1"
        store[s["metadata"]["name"]] = s
    dev = next(d["name"] for s in store.values() for d in s["spec"].get("devices") or [])
    claims = [_claim(("n1", dev))]
    index = SliceUsageIndex(DRIVER)
    assert index.usage(store, claims) == slice_usage(store.values(), claims, DRIVER)
    assert index.usage(store, claims).used > 0
    # n2 republishes a pool of two GPUs under a new generation: the next pass must see it.
    for s in [s for s in store.values() if s["spec"]["pool"]["name"] == "n2"]:
        del store[s["metadata"]["name"]]
    for s in _slices("n2", 2):
        s["spec"]["pool"]["generation"] = 2
        s["metadata"]["resourceVersion"] = "2"
        store[s["metadata"]["name"]] = s
    assert index.usage(store, claims) == slice_usage(store.values(), claims, DRIVER)
    assert index.usage(store, claims).gpus == 4
