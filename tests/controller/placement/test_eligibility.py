"""CEL selectors that fail at run time are errors for the claim, worded as kube-scheduler words
them (``claim <ns>/<name>, request <req>: selector #<i>: CEL runtime error: <error>``); a
selector that is merely false everywhere is a non-match that names the selector."""

from __future__ import annotations

import dataclasses

import pytest

from controller.claims import Alternative, DeviceClass, DeviceRequest, ExactRequest
from controller.model import ClusterModel
from controller.placement import NoPlacement, NoPlacementReason, PlacementEngine, PlacementRequest
from tests.support.cluster_builders import CLASSES, build_cluster, build_gpu, node_info
from tests.support.placement import A100, H100, NEEDS, PROFILE, claim, engine_for, place, placed

ATTR = 'device.attributes["mig.carve.dev"]'


def selecting(*selectors: str, count: int = 1, cls: str = "mig.carve.dev") -> DeviceRequest:
    return DeviceRequest("r", (Alternative("r", ExactRequest(cls, selectors, count=count)),))


def refused(result: object) -> NoPlacement:
    assert isinstance(result, NoPlacement), result
    return result


def test_string_compared_with_int_is_false_not_an_error_as_in_kube_scheduler() -> None:
    # Kubernetes v1.37.2's DRA CEL (cel-go heterogeneous equality) answers "1g.10gb" == 7 with
    # false and != 7 with true, without an error; so does carve. What was wrong is the message:
    # it said "matches DeviceClass mig.carve.dev and 1 selector(s)" without naming which.
    engine = engine_for(build_cluster(1, 2, [A100]))
    for count in (1, 2):  # the single-device path and the search
        result = refused(
            place(engine, "p", claim("a", selecting(f"{ATTR}.profile == 7", count=count)))
        )
        assert result.reason is NoPlacementReason.NO_MATCHING_DEVICE and not result.permanent
        assert result.message == (
            "claim ns/a, request r: selector #0 matches no device of DeviceClass mig.carve.dev"
        )
    placed(place(engine, "p", claim("a", selecting(f"{ATTR}.profile != 7"))))


def test_selector_that_narrows_to_nothing_is_named_with_the_ones_before_it() -> None:
    engine = engine_for(build_cluster(1, 1, [A100]))
    result = refused(
        place(
            engine,
            "p",
            claim("a", selecting(PROFILE.format("1g.10gb"), f"{ATTR}.placementStart == 99")),
        )
    )
    assert result.message == (
        "claim ns/a, request r: selectors #0 to #1 together match no device of DeviceClass "
        "mig.carve.dev"
    )


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("pinned", [None, "node-0000"])
def test_runtime_type_error_is_reported_with_the_cel_error(count: int, pinned: str | None) -> None:
    # string > int has no overload: kube-scheduler fails the claim with "no such overload".
    engine = engine_for(build_cluster(1, 2, [A100]))
    request = PlacementRequest(
        "p", NEEDS, (claim("a", selecting(f"{ATTR}.profile > 7", count=count)),), pinned
    )
    result = refused(engine.place(request))
    assert result.reason is NoPlacementReason.SELECTOR_ERROR and result.permanent
    assert result.message.startswith(
        "claim ns/a, request r: selector #0: CEL runtime error: No such overload"
    )


def test_missing_attribute_and_non_boolean_result_are_runtime_errors() -> None:
    engine = engine_for(build_cluster(1, 1, [A100]))
    missing = refused(
        place(engine, "p", claim("a", selecting(PROFILE.format("1g.10gb"), f"{ATTR}.nosuch == 1")))
    )
    assert missing.message == (
        "claim ns/a, request r: selector #1: CEL runtime error: no such key 'nosuch' "
        "(attribute or capacity missing on this device)"
    )
    text = refused(place(engine, "p", claim("a", selecting(f"{ATTR}.profile"))))
    assert text.message == (
        "claim ns/a, request r: selector #0: CEL runtime error: result is not a boolean: got str"
    )


def test_class_selector_errors_name_the_class() -> None:
    model = build_cluster(1, 1, [A100])
    careless = DeviceClass("careless.mig.carve.dev", (f"{ATTR}.placementSize <= 2",))
    engine = PlacementEngine(model, {**CLASSES, careless.name: careless})
    result = refused(place(engine, "p", claim("a", selecting(cls=careless.name))))
    assert result.reason is NoPlacementReason.SELECTOR_ERROR
    assert result.message.startswith(
        "claim ns/a, request r: class careless.mig.carve.dev: selector #0: CEL runtime error: "
        "no such key 'placementSize'"
    )


def test_compile_errors_are_reported_before_any_search() -> None:
    engine = engine_for(ClusterModel())  # no GPU anywhere
    result = refused(place(engine, "p", claim("a", selecting(f"{ATTR}.profile ==", count=3))))
    assert result.reason is NoPlacementReason.SELECTOR_ERROR and result.permanent
    assert result.message.startswith("claim ns/a, request r: selector #0: CEL compile error: ")


def test_error_met_only_while_explaining_is_still_an_error() -> None:
    # The selector fails on H100 devices only (false || error is an error, true || error is
    # true). The H100 node is cordoned, so the search never reads its devices; the refusal
    # does, and must report the error rather than fold its text into "lack room".
    model = ClusterModel()
    model.set_node(node_info("a100"))
    model.set_node_gpus("a100", [build_gpu("a100", 0, A100)])
    model.set_node(dataclasses.replace(node_info("h100"), unschedulable=True))
    model.set_node_gpus("h100", [build_gpu("h100", 0, H100)])
    engine = engine_for(model)
    selector = f'{ATTR}.productName.startsWith("NVIDIA A100") || {ATTR}.nosuch == 1'
    request = claim("a", selecting(PROFILE.format("7g.80gb"), selector, count=2))
    result = refused(place(engine, "p", request))
    assert result.reason is NoPlacementReason.SELECTOR_ERROR and result.permanent
    assert result.message.startswith("claim ns/a, request r: selector #1: CEL runtime error: ")
