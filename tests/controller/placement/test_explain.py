"""Refusals name each (request, explanation) once: requests that share an explanation are
grouped, and firstAvailable combinations are merged instead of repeated."""

from __future__ import annotations

from controller.model import ClusterModel
from controller.placement import NoPlacement, NoPlacementReason, PlacementEngine
from tests.support.cluster_builders import build_cluster, profile_claim
from tests.support.placement import (
    A100_40,
    NEEDS,
    claim,
    engine_for,
    exact,
    first_available,
    place,
    placed,
)

NO_3G = "no A100-SXM4-40GB GPU has a free 3g.20gb placement; 1 would after 1g.5gb pods finish"
NO_7G = "no A100-SXM4-40GB GPU has a free 7g.40gb placement; 1 would after 1g.5gb pods finish"
LACK = "0/1 GPU nodes can take the pod; 1 node(s) lack room for all its devices"


def full_a100_40() -> tuple[ClusterModel, PlacementEngine]:
    """One A100-40GB holding seven 1g.5gb slices: nothing bigger fits."""
    model = build_cluster(1, 1, [A100_40])
    engine = engine_for(model)
    for i in range(7):
        engine.commit(
            placed(place(engine, f"p{i}", profile_claim(f"c{i}", "1g.5gb"))), f"p{i}", NEEDS
        )
    return model, engine


def refused(result: object) -> NoPlacement:
    assert isinstance(result, NoPlacement), result
    assert result.reason is NoPlacementReason.INSUFFICIENT_DEVICES
    return result


def test_requests_with_the_same_explanation_are_named_together() -> None:
    _, engine = full_a100_40()
    three = claim("big", exact("a", "3g.20gb"), exact("b", "3g.20gb"), exact("c", "3g.20gb"))
    result = refused(place(engine, "x", three))
    assert result.message == f"{LACK}: ns/big requests a, b, c need a device each ({NO_3G})"
    counted = claim("big", exact("a", "3g.20gb", count=2), exact("b", "3g.20gb", count=2))
    result = refused(place(engine, "x", counted))
    assert result.message == f"{LACK}: ns/big requests a, b need 2 devices each ({NO_3G})"


def test_grouping_spans_claims_and_keeps_different_explanations_apart() -> None:
    _, engine = full_a100_40()
    result = refused(
        place(engine, "x", claim("one", exact("a", "3g.20gb")), claim("two", exact("a", "3g.20gb")))
    )
    assert result.message == (
        f"{LACK}: ns/one request a and ns/two request a need a device each ({NO_3G})"
    )
    mixed = refused(
        place(
            engine,
            "x",
            claim("m", exact("a", "3g.20gb"), exact("b", "7g.40gb"), exact("c", "3g.20gb")),
        )
    )
    assert mixed.message == (
        f"{LACK}: ns/m requests a, c need a device each ({NO_3G}); "
        f"ns/m request b needs a device ({NO_7G})"
    )


def test_first_available_combinations_are_merged_not_repeated() -> None:
    _, engine = full_a100_40()
    # Two combinations, (3g, b) and (7g, b); each used to be a full sentence naming b again.
    result = refused(
        place(engine, "x", claim("c", first_available("3g.20gb", "7g.40gb"), exact("b", "3g.20gb")))
    )
    assert result.message == (
        f"no alternative fits: {LACK}: ns/c requests gpu/3g-20gb, b ({NO_3G}); "
        f"ns/c request gpu/7g-40gb ({NO_7G})"
    )
    assert result.message.count(NO_3G) == 1
    alone = refused(place(engine, "x", claim("c", first_available("3g.20gb", "7g.40gb"))))
    assert alone.message == (
        "no alternative fits: no free placement: "
        f"ns/c request gpu/3g-20gb ({NO_3G}); ns/c request gpu/7g-40gb ({NO_7G})"
    )


def test_single_request_wording_is_unchanged() -> None:
    _, engine = full_a100_40()
    result = refused(place(engine, "x", claim("big", exact("a", "3g.20gb"))))
    assert result.message == f"no free placement: ns/big request a needs a device ({NO_3G})"
    result = refused(place(engine, "x", claim("big", exact("a", "3g.20gb", count=3))))
    assert result.message == f"{LACK}: ns/big request a needs 3 devices ({NO_3G})"


def test_first_available_keeps_a_different_refusal_as_its_own_sentence() -> None:
    _, engine = full_a100_40()
    result = refused(
        place(engine, "x", claim("c", first_available("3g.20gb", "9g.9gb", "7g.40gb")))
    )
    assert result.message == (
        "no alternative fits: no free placement: "
        f"ns/c request gpu/3g-20gb ({NO_3G}); ns/c request gpu/7g-40gb ({NO_7G}) | "
        "claim ns/c, request gpu/9g-9gb: selector #0 matches no device of DeviceClass mig.carve.dev"
    )
