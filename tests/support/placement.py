"""Builders for the placement engine's tests (tests/controller/test_placement.py,
tests/controller/placement/ and the model and toleration tests): an engine over a cluster
model, one pod's placement, claims of exact or first-available requests by profile."""

from __future__ import annotations

from controller.claims import Alternative, ClaimKey, ClaimSpec, DeviceRequest, ExactRequest
from controller.model import ClusterModel
from controller.nodefit import PodNeeds, Resources
from controller.placement import (
    ClaimToPlace,
    NoPlacement,
    Placement,
    PlacementEngine,
    PlacementRequest,
    Policy,
)
from driver.catalog import gpu_model
from tests.support.cluster_builders import CLASSES

A100 = gpu_model("A100-SXM4-80GB")
H100 = gpu_model("H100-SXM5-80GB")
A100_40 = gpu_model("A100-SXM4-40GB")
NEEDS = PodNeeds(Resources(1000, 2**30, 1))
PROFILE = 'device.attributes["mig.carve.dev"].profile == "{}"'


def engine_for(model: ClusterModel, policy: Policy = Policy.BEST_FIT) -> PlacementEngine:
    return PlacementEngine(model, CLASSES, policy=policy)


def place(engine: PlacementEngine, pod: str, *claims: ClaimToPlace) -> Placement | NoPlacement:
    return engine.place(PlacementRequest(pod, NEEDS, claims))


def placed(result: Placement | NoPlacement) -> Placement:
    assert isinstance(result, Placement), result
    return result


def claim(name: str, *requests: DeviceRequest, constraints=()) -> ClaimToPlace:  # type: ignore[no-untyped-def]
    return ClaimToPlace(
        ClaimKey("ns", name, f"uid-{name}"), ClaimSpec(requests, tuple(constraints))
    )


def exact(
    name: str, profile: str | None = None, count: int = 1, cls: str = "mig.carve.dev"
) -> DeviceRequest:
    selectors = (PROFILE.format(profile),) if profile else ()
    return DeviceRequest(name, (Alternative(name, ExactRequest(cls, selectors, count=count)),))


def first_available(*profiles: str) -> DeviceRequest:
    return DeviceRequest(
        "gpu",
        tuple(
            Alternative(
                f"gpu/{p.replace('.', '-')}", ExactRequest("mig.carve.dev", (PROFILE.format(p),))
            )
            for p in profiles
        ),
    )
