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


# A pinned limit against the device's memory (a slice's or a whole GPU's) and a container's own
# limits are checked with the model at hand: tests/controller/test_mpscheck.py.


def test_the_node_side_parser_gives_the_same_messages() -> None:
    with pytest.raises(ConfigError, match="must be an integer from 1 to 100, got 0"):
        parse_parameters(_params(defaultActiveThreadPercentage=0))
