"""Bad MPS settings are refused at placement time with a message naming the field (issue 16)."""

from __future__ import annotations

from typing import Any

import pytest

from controller.claims import ClaimSpecError, parse_claim_spec
from driver.config import ConfigError, parse_parameters

DRIVER = "mig.carve.dev"


def _params(**mps: Any) -> dict[str, Any]:
    return {
        "apiVersion": "mig.carve.dev/v1alpha1",
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": mps},
    }


def _claim(device_class: str, params: dict[str, Any], requests: list[str] | None = None) -> Any:
    entry: dict[str, Any] = {"opaque": {"driver": DRIVER, "parameters": params}}
    if requests is not None:
        entry["requests"] = requests
    return {
        "devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": device_class}},
                {"name": "slice", "exactly": {"deviceClassName": DRIVER}},
            ][: 1 if device_class != DRIVER else 2],
            "config": [entry],
        }
    }


@pytest.mark.parametrize("pct", [0, 101, -5, "50", True, 12.5])
def test_thread_percentage_outside_1_to_100(pct: object) -> None:
    with pytest.raises(ClaimSpecError, match="defaultActiveThreadPercentage: must be an integer"):
        parse_claim_spec(_claim(DRIVER, _params(defaultActiveThreadPercentage=pct)), DRIVER)


def test_pinned_limit_that_is_not_a_byte_quantity() -> None:
    with pytest.raises(ClaimSpecError, match="defaultPinnedDeviceMemoryLimit: '5 GB' is not"):
        parse_claim_spec(_claim(DRIVER, _params(defaultPinnedDeviceMemoryLimit="5 GB")), DRIVER)


def test_mps_on_a_whole_gpu_request_is_refused_and_says_why() -> None:
    with pytest.raises(ClaimSpecError) as e:
        parse_claim_spec(_claim("gpu.carve.dev", _params()), DRIVER)
    assert str(e.value).startswith(
        "spec.devices.config[0]: MPS sharing is supported on MIG slices only, but request "
        "'gpu' asks for a whole GPU (class gpu.carve.dev)"
    )


def test_mps_for_slices_only_and_other_strategies_on_a_gpu_are_fine() -> None:
    parse_claim_spec(_claim(DRIVER, _params(defaultActiveThreadPercentage=50)), DRIVER)
    timeslice = {**_params(), "sharing": {"strategy": "TimeSlicing"}}
    parse_claim_spec(_claim("gpu.carve.dev", timeslice), DRIVER)


def test_mps_config_naming_only_the_slice_request_of_a_mixed_claim() -> None:
    claim = {
        "devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.carve.dev"}},
                {"name": "slice", "exactly": {"deviceClassName": DRIVER}},
            ],
            "config": [
                {"requests": ["slice"], "opaque": {"driver": DRIVER, "parameters": _params()}}
            ],
        }
    }
    parse_claim_spec(claim, DRIVER)
    claim["devices"]["config"][0]["requests"] = ["gpu"]
    with pytest.raises(ClaimSpecError, match="request 'gpu' asks for a whole GPU"):
        parse_claim_spec(claim, DRIVER)


def test_the_node_side_parser_gives_the_same_messages() -> None:
    with pytest.raises(ConfigError, match="must be an integer from 1 to 100, got 0"):
        parse_parameters(_params(defaultActiveThreadPercentage=0))
