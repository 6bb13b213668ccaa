from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.catalog import CATALOG
from driver.naming import (
    ParsedDeviceName,
    counter_set_name,
    gpu_device_name,
    is_dns_label,
    memory_slice_counter,
    mig_device_name,
    parse_device_name,
    profile_slug,
)


def test_examples_from_the_contract() -> None:
    assert gpu_device_name(3) == "gpu-3"
    assert mig_device_name(0, "1g.10gb", 19, 3) == "gpu-0-mig-1g10gb-19-3"
    assert mig_device_name(1, "1g.10gb+me", 20, 0) == "gpu-1-mig-1g10gb-me-20-0"
    assert mig_device_name(0, "1g.24gb+me.all", 65, 9) == "gpu-0-mig-1g24gb-meall-65-9"
    assert mig_device_name(0, "1g.24gb-me", 67, 3) == "gpu-0-mig-1g24gb-me-67-3"
    assert counter_set_name(2) == "gpu-2-counters"
    assert memory_slice_counter(11) == "memory-slice-11"


def test_device_names_of_every_catalog_placement_are_distinct_dns_labels() -> None:
    """Slugs alone may collide (`+me` and `-me` both give `-me`); the profile id in the name
    keeps device names unique."""
    for model in CATALOG.values():
        names = [mig_device_name(7, p.name, p.id, s) for p in model.profiles for s in p.starts]
        assert len(set(names)) == len(names), model.key
        assert all(is_dns_label(n) for n in names)
    rtx = CATALOG["RTX-PRO-6000-Blackwell"]
    assert profile_slug(rtx.profile_by_id(21).name) == profile_slug(rtx.profile_by_id(67).name)


def test_parse_inverts_the_builders() -> None:
    assert parse_device_name("gpu-12") == ParsedDeviceName(minor=12)
    parsed = parse_device_name("gpu-1-mig-1g10gb-me-20-0")
    assert parsed == ParsedDeviceName(1, "1g10gb-me", 20, 0)
    assert parsed.is_mig and not parse_device_name("gpu-0").is_mig


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "gpu",
        "gpu-",
        "gpu-01",
        "GPU-0",
        "gpu-0-mig-1g10gb-19",
        "gpu-0-mig--19-3",
        "gpu-0-mig-1g.10gb-19-3",
        "gpu-0-mig-1g10gb-19-03",
        "gpu-x-mig-1g10gb-19-3",
        "nvidia-gpu-0",
        "gpu-0-mig-" + "a" * 60 + "-19-3",
    ],
)
def test_parse_rejects_other_names_with_the_expected_shape(bad: str) -> None:
    with pytest.raises(ValueError, match="expected 'gpu-<minor>'"):
        parse_device_name(bad)


def test_builders_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="minor"):
        gpu_device_name(-1)
    with pytest.raises(ValueError, match="start"):
        mig_device_name(0, "1g.10gb", 19, -2)
    with pytest.raises(ValueError, match="DNS"):
        profile_slug("1g 10gb")


@given(
    minor=st.integers(0, 4095),
    profile=st.sampled_from(sorted({p.name for m in CATALOG.values() for p in m.profiles})),
    pid=st.integers(0, 200),
    start=st.integers(0, 15),
)
def test_round_trip(minor: int, profile: str, pid: int, start: int) -> None:
    name = mig_device_name(minor, profile, pid, start)
    assert is_dns_label(name)
    assert parse_device_name(name) == ParsedDeviceName(minor, profile_slug(profile), pid, start)
