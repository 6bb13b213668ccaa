"""`carve status`'s picture: allocations from claims joined with the published GPUs."""

from __future__ import annotations

from typing import Any

from carvecli.clusterview import cluster_view, memory_map, render
from driver.catalog import gpu_model
from driver.naming import mig_device_name
from driver.resourceslice import PublishedGpu, build_resource_slices

DRIVER = "mig.carve.dev"
A100 = gpu_model("A100-SXM4-40GB")


def _slices(node: str, count: int = 1) -> list[dict[str, Any]]:
    gpus = [
        PublishedGpu(i, f"GPU-{node}-{i}", A100, f"0000:{i:02x}:00.0", "580.105.08")
        for i in range(count)
    ]
    return build_resource_slices(driver=DRIVER, node_name=node, pool_generation=1, gpus=gpus)


def _claim(name: str, node: str, devices: list[str], **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, **meta},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "r", "driver": DRIVER, "pool": node, "device": d}
                        for d in devices
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": "u"}],
        },
    }


def _mig(name: str, start: int, minor: int = 0) -> str:
    p = next(p for p in A100.profiles if p.name == name)
    return mig_device_name(minor, p.name, p.id, start)


def test_claims_are_drawn_on_their_gpu_with_what_still_fits() -> None:
    claims = [
        _claim("train", "n1", [_mig("3g.20gb", 4)]),
        _claim("pair", "n1", [_mig("1g.5gb", 0), _mig("1g.5gb", 1)]),
        _claim(
            "gone", "n1", [_mig("1g.5gb", 2, minor=1)], deletionTimestamp="2026-01-01T00:00:00Z"
        ),
        _claim("elsewhere", "other-node", [_mig("1g.5gb", 0)]),
    ]
    views = cluster_view(_slices("n1", 2), claims, DRIVER)
    assert [(v.node, v.minor) for v in views] == [("n1", 0), ("n1", 1)]
    gpu0, gpu1 = views
    assert memory_map(8, gpu0.held) == "AB..CCCC"
    assert [h.claim for h in gpu0.held] == ["ns/pair", "ns/pair", "ns/train"]
    assert gpu0.still_fits["1g.5gb"] == 2  # slices 2 and 3 remain
    assert "3g.20gb" not in gpu0.still_fits
    assert gpu1.held[0].releasing
    text = render(views)
    assert "node n1" in text and "claim ns/train" in text and "(for pod-train)" in text
    assert "[releasing]" in text


def test_overlapping_allocations_are_reported_not_hidden() -> None:
    claims = [
        _claim("a", "n1", [_mig("3g.20gb", 4)]),
        _claim("b", "n1", [_mig("1g.5gb", 5)]),
    ]
    [view] = cluster_view(_slices("n1"), claims, DRIVER)
    assert view.problem
    assert "#" in memory_map(8, view.held)


def test_whole_gpu_and_empty_cluster() -> None:
    [view] = cluster_view(_slices("n1"), [_claim("w", "n1", ["gpu-0"])], DRIVER)
    assert view.still_fits == {}
    assert memory_map(8, view.held) == "AAAAAAAA"
    assert "nothing (full)" in render([view])
    assert "no GPUs" in render([])
