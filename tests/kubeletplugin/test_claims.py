from __future__ import annotations

from typing import Any

import pytest

from kubeletplugin.claims import ClaimFormatError, parse_claim


def _claim(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": "c",
            "uid": "u-1",
            "resourceVersion": "7",
            "finalizers": ["x/y"],
        },
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": status,
    }


def test_parse_allocated_claim() -> None:
    view = parse_claim(
        _claim(
            allocation={
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": "mig.carve.dev", "pool": "n1", "device": "d"},
                        {"request": "nic", "driver": "other", "pool": "n1", "device": "e"},
                    ],
                    "config": [
                        {
                            "source": "FromClass",
                            "requests": ["gpu"],
                            "opaque": {"driver": "mig.carve.dev", "parameters": {"a": 1}},
                        },
                        {"source": "FromClaim"},
                    ],
                }
            },
            reservedFor=[{"resource": "pods", "name": "p", "uid": "pu"}],
        )
    )
    assert view.allocated and not view.deleting
    assert [r.device for r in view.results_for("mig.carve.dev")] == ["d"]
    assert len(view.config) == 1 and view.config[0].parameters == {"a": 1}
    assert view.config[0].source == "FromClass" and view.config[0].requests == ("gpu",)
    assert view.reserved_for == ("pods/p",)
    assert view.finalizers == ("x/y",)


def test_unallocated_and_deleting() -> None:
    obj = _claim()
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    view = parse_claim(obj)
    assert not view.allocated and view.deleting and view.results == ()


def test_malformed_result_is_a_format_error() -> None:
    obj = _claim(allocation={"devices": {"results": [{"request": "gpu", "driver": 3}]}})
    with pytest.raises(ClaimFormatError, match=r"results\[0\]\.driver"):
        parse_claim(obj)
