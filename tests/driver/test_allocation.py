"""The one model of an allocated device: parse what the API serves, write what it expects."""

from __future__ import annotations

import pytest

from driver.allocation import (
    AllocatedDevice,
    AllocationFormatError,
    parse_allocation,
    result_json,
)

DRIVER = "mig.carve.dev"


def test_results_config_and_node_are_parsed_once() -> None:
    allocation = parse_allocation(
        {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": DRIVER,
                        "pool": "n1",
                        "device": "d",
                        "adminAccess": True,
                        "shareID": "s-1",
                        "tolerations": [{"key": "k", "operator": "Exists"}],
                    },
                    {"request": "nic", "driver": "other", "pool": "n1", "device": "e"},
                ],
                "config": [
                    {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"a": 1}}},
                    {"source": "FromClass"},
                ],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
                ]
            },
        }
    )
    (ours,) = allocation.results_for(DRIVER)
    assert ours.admin_access and ours.share_id == "s-1"
    assert ours.tolerations == [{"key": "k", "operator": "Exists"}]
    assert allocation.node == "n1"
    (config,) = allocation.config
    assert config.source == "FromClaim" and config.requests == ("gpu",)
    assert parse_allocation(None).results == ()


def test_result_json_round_trips() -> None:
    raw = {"request": "r", "driver": DRIVER, "pool": "p", "device": "d", "shareID": "x"}
    (parsed,) = parse_allocation({"devices": {"results": [raw]}}).results
    assert result_json(parsed) == raw


def test_binding_conditions_round_trip_and_are_checked() -> None:
    raw = {
        "request": "r",
        "driver": DRIVER,
        "pool": "p",
        "device": "d",
        "bindingConditions": [f"{DRIVER}/Carved"],
        "bindingFailureConditions": [f"{DRIVER}/CarveFailed"],
    }
    (parsed,) = parse_allocation({"devices": {"results": [raw]}}).results
    assert parsed.binding_conditions == (f"{DRIVER}/Carved",)
    assert parsed.binding_failure_conditions == (f"{DRIVER}/CarveFailed",)
    assert result_json(parsed) == raw
    with pytest.raises(AllocationFormatError, match=r"results\[0\]\.bindingConditions: expected a"):
        parse_allocation({"devices": {"results": [{**raw, "bindingConditions": [3]}]}})


def test_errors_name_the_field() -> None:
    with pytest.raises(AllocationFormatError, match=r"results\[0\]\.pool is missing"):
        parse_allocation({"devices": {"results": [{"request": "r", "driver": DRIVER}]}})
    with pytest.raises(AllocationFormatError, match=r"status\.allocation\.devices: expected"):
        parse_allocation({"devices": []})


def test_profile_is_not_identity_and_sorting_tolerates_missing_share_ids() -> None:
    planned = AllocatedDevice("r", DRIVER, "p", "d", profile="1g.10gb")
    assert planned == AllocatedDevice("r", DRIVER, "p", "d")
    shared = AllocatedDevice("r", DRIVER, "p", "d", share_id="s")
    assert sorted([shared, planned], key=AllocatedDevice.sort_key) == [shared, planned]
