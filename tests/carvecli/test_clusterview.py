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


def _rule(name: str, selector: dict[str, Any] | None, effect: str = "NoSchedule") -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": "example.com/maintenance", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"metadata": {"name": name}, "spec": spec}


def test_status_names_the_rules_and_node_taints_on_each_gpu() -> None:
    """Issue 31: an admin's DeviceTaintRule shows on the GPUs it covers, named, as the
    controller applies it; a rule without a selector covers nothing (kube-scheduler's rule)."""
    slices = _slices("n1", 2) + _slices("n2")
    device = next(d for s in slices for d in s["spec"].get("devices") or [] if d["name"] == "gpu-1")
    device["taints"] = [
        {"key": "mig.carve.dev/gpu-unhealthy", "value": "xid-79", "effect": "NoExecute"}
    ]
    rules = [
        _rule("n1-maintenance", {"driver": DRIVER, "pool": "n1"}),
        _rule("one-slice", {"pool": "n1", "device": _mig("1g.5gb", 0, minor=1)}, "None"),
        _rule("no-selector", None),
        _rule("other-driver", {"driver": "gpu.nvidia.com"}),
    ]
    gpu0, gpu1, other = cluster_view(slices, [], DRIVER, rules=rules)
    devices = gpu0.taints[0].of  # every MIG placement and the whole GPU
    assert devices > 20
    assert [(t.taint, t.source, t.devices) for t in gpu0.taints] == [
        ("example.com/maintenance:NoSchedule", "DeviceTaintRule n1-maintenance", devices)
    ]
    assert [(t.taint, t.source, t.devices) for t in gpu1.taints] == [
        ("example.com/maintenance:NoSchedule", "DeviceTaintRule n1-maintenance", devices),
        ("example.com/maintenance:None", "DeviceTaintRule one-slice", 1),
        ("mig.carve.dev/gpu-unhealthy=xid-79:NoExecute", "the node", 1),
    ]
    assert other.taints == ()
    text = render([gpu0, gpu1, other])
    assert (
        "tainted example.com/maintenance:NoSchedule by DeviceTaintRule n1-maintenance, on all "
        f"{devices} devices"
    ) in text
    assert "tainted example.com/maintenance:None by DeviceTaintRule one-slice, on 1 of" in text
    assert "no-selector" not in text and "other-driver" not in text
    assert "still fits (for claims that tolerate those taints): 1g.5gb x7" in text
    assert "still fits: 1g.5gb x7" in render([other])
