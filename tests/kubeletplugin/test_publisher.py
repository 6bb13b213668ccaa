from __future__ import annotations

import pytest

from kubeletplugin.publisher import _content_hash, parse_server_version, uses_split_counters


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ({"major": "1", "minor": "37"}, (1, 37)),
        ({"major": "1", "minor": "35+"}, (1, 35)),
        ({"major": "", "minor": "", "gitVersion": "v1.34.2-gke.1"}, (1, 34)),
    ],
)
def test_server_version(version: dict[str, str], expected: tuple[int, int]) -> None:
    assert parse_server_version(version) == expected


def test_server_version_garbage() -> None:
    with pytest.raises(ValueError, match="cannot read"):
        parse_server_version({"major": "x"})


def test_split_from_135() -> None:
    assert not uses_split_counters((1, 34))
    assert uses_split_counters((1, 35))
    assert uses_split_counters((2, 0))


def test_content_hash_ignores_generation_only() -> None:
    a = {"pool": {"name": "n", "generation": 1, "resourceSliceCount": 2}, "devices": [1]}
    b = {"pool": {"name": "n", "generation": 9, "resourceSliceCount": 2}, "devices": [1]}
    c = {"pool": {"name": "n", "generation": 1, "resourceSliceCount": 2}, "devices": [2]}
    assert _content_hash(a) == _content_hash(b) != _content_hash(c)
