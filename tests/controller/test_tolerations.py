"""Device taints and claim tolerations at placement (issue 11, point 2): parsed from claims,
read from ResourceSlices, and honoured by the engine with a message when nothing is left."""

from __future__ import annotations

from typing import Any

import pytest

from controller.claims import ClaimSpecError, parse_claim_spec
from controller.model import ClusterModel, inventories_from_slices
from controller.placement import NoPlacement
from controller.tolerations import DeviceTaint, Toleration, blocking
from driver.catalog import gpu_model
from driver.resourceslice import PublishedGpu, build_resource_slices
from tests.support.cluster_builders import node_info
from tests.support.placement import claim, engine_for, place, placed

DRIVER = "mig.carve.dev"
KEY = "mig.carve.dev/gpu-unhealthy"
FATAL = {"key": KEY, "value": "xid-79", "effect": "NoExecute"}


def test_toleration_matching_follows_kubernetes() -> None:
    fatal = DeviceTaint(KEY, "xid-79", "NoExecute")
    degraded = DeviceTaint(KEY, "xid-92", "NoSchedule")
    none = DeviceTaint("other.io/x", "", "None")
    assert blocking([fatal, degraded, none], ()) == [fatal, degraded]  # None never blocks
    exists = Toleration(KEY, "Exists")
    assert blocking([fatal, degraded], (exists,)) == []
    only_no_schedule = Toleration(KEY, "Exists", effect="NoSchedule")
    assert blocking([fatal, degraded], (only_no_schedule,)) == [fatal]
    equal = Toleration(KEY, "Equal", "xid-92")
    assert blocking([fatal, degraded], (equal,)) == [fatal]
    assert blocking([fatal, degraded], (Toleration(operator="Exists"),)) == []


@pytest.mark.parametrize(
    ("tolerations", "message"),
    [
        ([{"operator": "Equal", "value": "x"}], r"\[0\].key: a toleration without a key"),
        ([{"key": KEY, "operator": "In"}], r"\[0\].operator: 'In' is not Exists or Equal"),
        ([{"key": KEY, "effect": "Evict"}], r"\[0\].effect: 'Evict' is not NoSchedule"),
        ([{"key": KEY, "operator": "Exists", "value": "v"}], "must be empty with operator Exists"),
        ([{"key": "bad key!"}], "is not a label key"),
        ([{"key": KEY, "tolerationSeconds": "60"}], "tolerationSeconds: must be an integer"),
        ("all", "must be a list"),
    ],
)
def test_a_bad_toleration_is_refused_naming_the_field(tolerations: Any, message: str) -> None:
    body = {"deviceClassName": "mig.carve.dev", "tolerations": tolerations}
    with pytest.raises(ClaimSpecError, match=r"spec.devices.requests\[0\].exactly.tolerations"):
        parse_claim_spec({"devices": {"requests": [{"name": "r", "exactly": body}]}}, DRIVER)
    with pytest.raises(ClaimSpecError, match=message):
        parse_claim_spec({"devices": {"requests": [{"name": "r", "exactly": body}]}}, DRIVER)


def test_tolerations_are_parsed_into_the_request() -> None:
    body = {
        "deviceClassName": "mig.carve.dev",
        "tolerations": [{"key": KEY, "operator": "Exists", "tolerationSeconds": 30}],
    }
    parsed = parse_claim_spec({"devices": {"requests": [{"name": "r", "exactly": body}]}}, DRIVER)
    spec = parsed.requests[0].alternatives[0].spec
    assert spec.tolerations == (Toleration(KEY, "Exists"),)


def _model(*taints: tuple[dict[str, str], ...]) -> ClusterModel:
    gpus = [
        PublishedGpu(i, f"GPU-n-{i}", gpu_model("H100-SXM5-80GB"), f"0000:{16 + i:02x}:00.0",
                     "580.105.08", taints=t)
        for i, t in enumerate(taints)
    ]  # fmt: skip
    slices = build_resource_slices(driver=DRIVER, node_name="n", pool_generation=1, gpus=gpus)
    model = ClusterModel()
    model.set_node(node_info("n"))
    model.set_node_gpus("n", inventories_from_slices(slices, DRIVER))
    return model


def _request(tolerations: list[dict[str, Any]] | None = None) -> Any:
    body: dict[str, Any] = {"deviceClassName": "mig.carve.dev"}
    if tolerations:
        body["tolerations"] = tolerations
    parsed = parse_claim_spec({"devices": {"requests": [{"name": "r", "exactly": body}]}}, DRIVER)
    return parsed.requests[0]


def test_the_engine_avoids_tainted_gpus_unless_tolerated() -> None:
    model = _model((FATAL,), ())
    got = placed(place(engine_for(model), "p", claim("c", _request())))
    (choice,) = got.choices
    assert choice.gpu_uuid == "GPU-n-1"  # the healthy GPU, although gpu-0 sorts first
    only_sick = _model((FATAL,))
    refused = place(engine_for(only_sick), "p", claim("c", _request()))
    assert isinstance(refused, NoPlacement)
    assert f"has a taint the request does not tolerate ({KEY}=xid-79:NoExecute)" in (
        refused.message
    )
    tolerant = _request([{"key": KEY, "operator": "Exists"}])
    assert placed(place(engine_for(only_sick), "p", claim("c", tolerant))).choices
