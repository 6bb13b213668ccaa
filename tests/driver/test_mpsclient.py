"""The per-client MPS variables, read as CUDA documents them (driver.mpsclient)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.mpsclient import (
    ClientLimitError,
    ClientLimits,
    parse_client_env,
    parse_pinned_limit,
    parse_thread_percentage,
)

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@pytest.mark.parametrize("value", ["1", "50", "100", " 30 "])
def test_thread_percentages_from_1_to_100(value: str) -> None:
    assert parse_thread_percentage(value) == int(value)


@pytest.mark.parametrize("value", ["0", "101", "-5", "12.5", "half", ""])
def test_thread_percentages_outside_the_range_name_the_variable(value: str) -> None:
    with pytest.raises(
        ClientLimitError, match=r"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=.*from 1 to 100"
    ):
        parse_thread_percentage(value)


@given(
    st.dictionaries(
        st.integers(0, 7),
        st.tuples(st.integers(1, 4096), st.sampled_from(list(_UNITS)), st.booleans()),
        min_size=1,
    )
)
def test_pinned_limits_read_back_per_device(limits: dict[int, tuple[int, str, bool]]) -> None:
    text = ",".join(
        f"{i}={n}{unit}{'B' if b and unit else ''}" for i, (n, unit, b) in limits.items()
    )
    assert parse_pinned_limit(text) == {i: n * _UNITS[u] for i, (n, u, _) in limits.items()}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("2G", "'2G' is not <device index>=<amount>"),
        ("0=2X", "'0=2X' is not"),
        ("0=1G,0=2G", "device 0 given twice"),
        ("0=0", "device 0 limit is 0"),
        ("", "'' is not"),
    ],
)
def test_bad_pinned_limits_say_what_is_wrong(value: str, why: str) -> None:
    with pytest.raises(ClientLimitError, match="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") as e:
        parse_pinned_limit(value)
    assert why in str(e.value)


def test_a_container_env_without_the_variables_asks_nothing() -> None:
    limits = parse_client_env({"PATH": "/bin"})
    assert limits == ClientLimits() and limits.empty and limits.largest_pinned_bytes is None


def test_a_container_env_with_both() -> None:
    limits = parse_client_env(
        {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G,1=3G"}
    )
    assert limits.thread_percentage == 25
    assert limits.largest_pinned_bytes == 3 * 2**30
