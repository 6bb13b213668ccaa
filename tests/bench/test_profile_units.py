"""What a request for a MIG profile by name weighs in `bench.packing`'s placed units."""

from __future__ import annotations

import itertools

import pytest

from driver.catalog import gpu_model
from tests.support.cluster_builders import profile_units

FLEET = ("A100-SXM4-80GB", "H100-SXM5-80GB", "A100-SXM4-40GB")


@pytest.mark.parametrize("order", list(itertools.permutations(FLEET)))
def test_a_name_weighs_its_smallest_size_whatever_the_order_of_the_models(
    order: tuple[str, ...],
) -> None:
    units = profile_units(gpu_model(k) for k in order)
    # One memory slice of an A100-80GB or an H100, two of an A100-40GB.
    assert units["1g.10gb"] == 1
    assert units["1g.20gb"] == 2
    assert units["1g.5gb"] == 1
    assert units["3g.40gb"] == 4
    assert units["7g.40gb"] == 8


def test_a_name_only_one_model_offers_weighs_its_size_there() -> None:
    assert profile_units([gpu_model("A100-SXM4-40GB")])["1g.10gb"] == 2
    assert profile_units([gpu_model("A30-24GB")]) == {
        "1g.6gb": 1,
        "1g.6gb+me": 1,
        "2g.12gb": 2,
        "2g.12gb+me": 2,
        "4g.24gb": 4,
    }
