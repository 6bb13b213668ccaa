from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controller.claims import (
    AllocationMode,
    ClaimSpecError,
    ConstraintKind,
    parse_claim_hold,
    parse_claim_spec,
    parse_device_class,
)
from driver.allocation import AllocatedDevice

DRIVER = "mig.carve.dev"


TIME_SLICING = {
    "apiVersion": "mig.carve.dev/v1alpha1",
    "kind": "MigDeviceConfig",
    "sharing": {"strategy": "TimeSlicing"},
}


def spec(*requests: dict[str, Any], **devices: Any) -> dict[str, Any]:
    return {"devices": {"requests": list(requests), **devices}}


def test_exactly_first_available_constraints_and_config() -> None:
    parsed = parse_claim_spec(
        spec(
            {
                "name": "big",
                "exactly": {
                    "deviceClassName": "mig.carve.dev",
                    "count": 2,
                    "selectors": [{"cel": {"expression": "true"}}],
                    "capacity": {"requests": {"memory": "40Gi"}},
                },
            },
            {
                "name": "any",
                "firstAvailable": [
                    {"name": "large", "deviceClassName": "mig.carve.dev"},
                    {"name": "whole", "deviceClassName": "gpu.carve.dev", "allocationMode": "All"},
                ],
            },
            constraints=[
                {"requests": ["big"], "matchAttribute": "mig.carve.dev/parentUUID"},
                {"distinctAttribute": "mig.carve.dev/uuid"},
            ],
            config=[
                {
                    "requests": ["big"],
                    "opaque": {"driver": "other.example.com", "parameters": {"b": 1}},
                },
                {"opaque": {"driver": DRIVER, "parameters": TIME_SLICING}},
            ],
        ),
        DRIVER,
    )
    big, anyreq = parsed.requests
    assert big.alternatives[0].spec.count == 2
    assert big.alternatives[0].spec.capacity == (("mig.carve.dev/memory", Decimal(40 * 2**30)),)
    assert not big.uses_first_available
    assert [a.result_name for a in anyreq.alternatives] == ["any/large", "any/whole"]
    assert anyreq.alternatives[1].spec.mode is AllocationMode.ALL
    assert [c.kind for c in parsed.constraints] == [ConstraintKind.MATCH, ConstraintKind.DISTINCT]
    assert parsed.constraints[0].applies_to("big") and not parsed.constraints[0].applies_to("any")
    assert parsed.config[0].opaque.parameters == {"b": 1}
    assert sorted(parsed.device_classes()) == ["gpu.carve.dev", "mig.carve.dev", "mig.carve.dev"]


@pytest.mark.parametrize(
    ("claim", "fragment"),
    [
        (spec(), "requests no devices"),
        (
            spec(
                {"name": "r", "exactly": {"deviceClassName": "x"}},
                config=[
                    {
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {**TIME_SLICING, "sharing": {"strategy": "Bogus"}},
                        }
                    }
                ],
            ),
            "spec.devices.config[0].opaque.parameters.sharing.strategy",
        ),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x", "futureField": True}}),
            "requests[0].exactly.futureField: carve does not support this field",
        ),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x"}, "pinned": "x"}),
            "requests[0].pinned: carve does not support this field",
        ),
        (
            spec(
                {"name": "r", "exactly": {"deviceClassName": "x"}},
                constraints=[{"matchAttribute": "a/b", "weird": 1}],
            ),
            "constraints[0].weird: carve does not support",
        ),
        (spec({"name": "Bad_Name", "exactly": {"deviceClassName": "x"}}), "not a DNS label"),
        (spec({"name": "r"}), "exactly one of exactly or firstAvailable"),
        (spec({"name": "r", "exactly": {}}), "requests[0].exactly.deviceClassName: required"),
        (spec({"name": "r", "exactly": {"deviceClassName": "x", "count": 0}}), "positive integer"),
        (spec({"name": "r", "exactly": {"deviceClassName": "x", "count": 99}}), "limit of 32"),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x", "allocationMode": "Some"}}),
            "'Some' is not ExactCount or All",
        ),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x", "adminAccess": True}}),
            "admin access is not supported",
        ),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x", "selectors": [{"cel": {}}]}}),
            "selectors[0].cel.expression",
        ),
        (
            spec(
                {
                    "name": "r",
                    "exactly": {
                        "deviceClassName": "x",
                        "capacity": {"requests": {"memory": "lots"}},
                    },
                }
            ),
            "capacity.requests[memory]: invalid quantity 'lots'",
        ),
        (spec({"name": "r", "firstAvailable": []}), "at least one subrequest"),
        (
            spec({"name": "r", "firstAvailable": [{"name": "a", "deviceClassName": "x"}] * 2}),
            "duplicate subrequest name 'a'",
        ),
        (
            spec(
                {"name": "r", "exactly": {"deviceClassName": "x"}},
                constraints=[{"matchAttribute": "parentUUID"}],
            ),
            "must be a fully qualified attribute name",
        ),
        (
            spec(
                {"name": "r", "exactly": {"deviceClassName": "x"}},
                constraints=[{"requests": ["nope"], "matchAttribute": "a.b/c"}],
            ),
            "'nope' is not a request of this claim",
        ),
        (
            spec(
                {"name": "r", "exactly": {"deviceClassName": "x"}},
                constraints=[{"matchAttribute": "a.b/c", "distinctAttribute": "a.b/c"}],
            ),
            "exactly one of matchAttribute or distinctAttribute",
        ),
        (
            spec({"name": "r", "exactly": {"deviceClassName": "x"}}, config=[{"requests": []}]),
            "config[0].opaque: required",
        ),
    ],
)
def test_invalid_claims_name_the_field(claim: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ClaimSpecError) as info:
        parse_claim_spec(claim, DRIVER)
    assert fragment in str(info.value)


def test_device_class() -> None:
    cls = parse_device_class(
        {
            "metadata": {"name": "mig.carve.dev"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "mig.carve.dev"'}}]},
        }
    )
    assert cls.selectors == ('device.driver == "mig.carve.dev"',)
    with pytest.raises(ClaimSpecError, match=r"metadata\.name"):
        parse_device_class({"spec": {}})


def test_claim_hold_from_status() -> None:
    claim = {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "r", "driver": DRIVER, "pool": "n1", "device": "gpu-0-mig-x"},
                        {"request": "s", "driver": "other.dev", "pool": "n1", "device": "d"},
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["n1"]}
                            ]
                        }
                    ]
                },
            }
        },
    }
    hold = parse_claim_hold(claim, DRIVER)
    assert hold is not None
    assert hold.node == "n1"
    assert hold.devices == (AllocatedDevice("r", DRIVER, "n1", "gpu-0-mig-x"),)
    assert str(hold.claim) == "ns/c" and hold.claim.uid == "u1"
    assert parse_claim_hold({"metadata": {"name": "c"}, "status": {}}, DRIVER) is None
