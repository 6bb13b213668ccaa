"""carve's quantity parser agrees with the official client's on every quantity the API admits."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.utils import parse_quantity as client_parse_quantity

from driver.quantity import parse_quantity, whole_quantity

_SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E"]


@given(
    st.integers(min_value=0, max_value=10**6),
    st.integers(min_value=0, max_value=999),
    st.booleans(),
    st.sampled_from(_SUFFIXES),
)
def test_every_suffix_reads_as_the_official_client_reads_it(
    whole: int, fraction: int, with_fraction: bool, suffix: str
) -> None:
    text = f"{whole}.{fraction:03d}{suffix}" if with_fraction else f"{whole}{suffix}"
    assert parse_quantity(text) == Decimal(client_parse_quantity(text))


@given(st.integers(min_value=-30, max_value=30), st.integers(min_value=0, max_value=10**4))
def test_exponents_read_as_the_official_client_reads_them(exponent: int, number: int) -> None:
    text = f"{number}e{exponent}"
    assert parse_quantity(text) == Decimal(client_parse_quantity(text))


@pytest.mark.parametrize("text", ["lots", "", "1.2.3", "5Xi", "Gi", "1 Gi"])
def test_a_non_quantity_is_refused_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(text)


def test_whole_units_are_exact_and_fractions_refused() -> None:
    assert whole_quantity("40Gi") == 40 * 2**30
    assert whole_quantity(7) == 7
    assert whole_quantity("1e3") == 1000
    with pytest.raises(ValueError, match="not a whole number"):
        whole_quantity("500m")
    with pytest.raises(ValueError, match="not a number"):
        whole_quantity(True)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("10468982784", 10468982784),
        ("40Gi", 40 << 30),
        ("9984Mi", 9984 * 2**20),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("1e3", 1000),
        ("1.5Ki", 1536),
        (7, 7),
    ],
)
def test_whole_quantities_in_every_form_the_apiserver_returns(text: str | int, value: int) -> None:
    assert whole_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.5", "500m", "1 Gi", "ten", True, None])
def test_bad_whole_quantities_are_refused(text: object) -> None:
    with pytest.raises(ValueError):
        whole_quantity(text)
