from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.config import (
    API_VERSION,
    ConfigError,
    MigDeviceConfig,
    MpsConfig,
    OpaqueConfigEntry,
    SharingStrategy,
    TimeSliceInterval,
    parse_parameters,
    resolve_config,
)

DRIVER = "mig.carve.dev"


def _params(**sharing: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": sharing}


def test_defaults_are_exclusive() -> None:
    cfg = parse_parameters({"apiVersion": API_VERSION, "kind": "MigDeviceConfig"})
    assert cfg == MigDeviceConfig()
    assert cfg.container_env() == {"CARVE_SHARING_STRATEGY": "None"}


def test_mps_fields_reach_the_environment() -> None:
    cfg = parse_parameters(
        _params(
            strategy="MPS",
            mpsConfig={
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "2Gi",
            },
        )
    )
    assert cfg.sharing.strategy is SharingStrategy.MPS
    assert cfg.sharing.mps == MpsConfig(50, 2 * 2**30)
    # The daemon applies the limits; a CDI variable would override a container's own, lower one.
    assert cfg.container_env() == {"CARVE_SHARING_STRATEGY": "MPS"}


def test_time_slicing_interval() -> None:
    cfg = parse_parameters(_params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}))
    assert cfg.sharing.time_slicing is not None
    assert cfg.sharing.time_slicing.interval is TimeSliceInterval.LONG
    assert cfg.container_env()["CARVE_TIME_SLICE_INTERVAL"] == "Long"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"apiVersion": "v1", "kind": "MigDeviceConfig"}, r"apiVersion: 'v1' is not supported"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig"}, r"kind: 'GpuConfig'"),
        ({"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharin": {}}, r"'sharin'"),
        (_params(strategy="Shared"), r"sharing.strategy: 'Shared' is not one of None"),
        (_params(strategy="MPS", mpsConfig={"threads": 1}), r"unknown field\(s\) 'threads'"),
        (
            _params(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 0}),
            "1 to 100",
        ),
        (
            _params(strategy="MPS", mpsConfig={"defaultPinnedDeviceMemoryLimit": "lots"}),
            "byte quantity",
        ),
        (_params(strategy="None", mpsConfig={}), "only valid with strategy MPS"),
        (_params(strategy="TimeSlicing", timeSlicingConfig={"interval": 3}), "interval"),
        ("a string", "expected an object"),
    ],
)
def test_bad_parameters_name_the_field(params: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_parameters(params)


def _entry(source: str, params: Any, requests: tuple[str, ...] = (), driver: str = DRIVER) -> Any:
    return OpaqueConfigEntry(source, requests, driver, params)


def test_claim_overrides_class_regardless_of_list_order() -> None:
    entries = [
        _entry("FromClaim", _params(strategy="MPS")),
        _entry("FromClass", _params(strategy="TimeSlicing")),
    ]
    assert resolve_config(entries, DRIVER, "gpu").sharing.strategy is SharingStrategy.MPS


def test_entries_filtered_by_driver_and_request() -> None:
    entries = [
        _entry("FromClaim", _params(strategy="MPS"), requests=("other",)),
        _entry("FromClaim", {"garbage": True}, driver="gpu.nvidia.com"),
        _entry("FromClaim", _params(strategy="TimeSlicing"), requests=("gpu",)),
    ]
    assert resolve_config(entries, DRIVER, "gpu/small").sharing.strategy is (
        SharingStrategy.TIME_SLICING
    )
    assert resolve_config(entries, DRIVER, "other").sharing.strategy is SharingStrategy.MPS
    assert resolve_config([], DRIVER, "x") == MigDeviceConfig()


def test_overridden_but_broken_entry_still_reported() -> None:
    entries = [
        _entry("FromClass", _params(strategy="Bogus")),
        _entry("FromClaim", _params(strategy="MPS")),
    ]
    with pytest.raises(ConfigError, match=r"config\[0\] \(FromClass\)"):
        resolve_config(entries, DRIVER, "gpu")


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.integers(), max_size=3))
def test_unknown_top_level_fields_always_rejected(extra: dict[str, int]) -> None:
    params: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **extra}
    if set(extra) - {"apiVersion", "kind", "sharing"}:
        with pytest.raises(ConfigError):
            parse_parameters(params)
