"""Slice utilization/fragmentation gauges, controller metrics, and the entry point's flags."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from prometheus_client import generate_latest

from controller.main import build_parser, parse_duration
from controller.metrics import ControllerMetrics, slice_usage
from controller.reconciler import Kind
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices

Obj = dict[str, Any]
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


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        parse_duration("five minutes")


def test_flags_have_environment_equivalents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARVE_NATIVE_FALLBACK_AFTER", "10m")
    monkeypatch.setenv("CARVE_DRIVER_NAME", "mig.example.org")
    args = build_parser().parse_args([])
    assert args.native_fallback_after == "10m"
    assert args.driver_name == "mig.example.org"
    args = build_parser().parse_args(["--driver-name", "x.example.org"])
    assert args.driver_name == "x.example.org"


def test_http_endpoints() -> None:
    import urllib.error
    import urllib.request

    from controller.main import serve_http

    ready = [False]
    m = ControllerMetrics()
    m.set_queue_depth(2)
    server = serve_http("127.0.0.1:0", m, lambda: ready[0])
    try:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{base}/healthz") as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/readyz")
        assert err.value.code == 503
        ready[0] = True
        with urllib.request.urlopen(f"{base}/readyz") as r:
            assert r.status == 200
        with urllib.request.urlopen(f"{base}/metrics") as r:
            assert b"carve_pending_pods 2.0" in r.read()
    finally:
        server.stop()
