"""The GPU health file: what a restarted plugin starts from (kubeletplugin.healthstate)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from driver.gpuhealth import Condition, Severity
from kubeletplugin.healthstate import (
    HealthStateError,
    HealthStateFile,
    SavedHealth,
    decode,
    encode,
)

_conditions = st.dictionaries(
    st.from_regex(r"GPU-[0-9a-f]{8}", fullmatch=True),
    st.builds(
        Condition,
        severity=st.sampled_from([Severity.DEGRADED, Severity.FATAL]),
        value=st.from_regex(r"xid-[0-9]{1,3}", fullmatch=True),
        reason=st.text(max_size=40),
        since=st.floats(min_value=0, max_value=1e5),
        last_event=st.floats(min_value=0, max_value=1e5),
        ecc_uncorrected=st.none() | st.integers(min_value=0, max_value=10**6),
        recovery_asked=st.booleans(),
    ),
    max_size=8,
)


@given(_conditions, st.floats(min_value=0, max_value=1e6))
def test_conditions_survive_a_restart_on_another_monotonic_clock(
    conditions: dict[str, Condition], later: float
) -> None:
    """Written at monotonic 1e5 / wall 1.7e9, read `later` seconds on by a process whose
    monotonic clock restarted at 0: every age (now - since) is kept."""
    text = encode(conditions, mono_now=1e5, wall_now=1.7e9)
    back = decode(text, mono_now=0.0, wall_now=1.7e9 + later).gpus
    assert back.keys() == conditions.keys()
    for gpu, c in conditions.items():
        b = back[gpu]
        assert (b.severity, b.value, b.reason) == (c.severity, c.value, c.reason)
        assert (b.ecc_uncorrected, b.recovery_asked) == (c.ecc_uncorrected, c.recovery_asked)
        assert (0.0 - b.since) == pytest.approx(1e5 - c.since + later, abs=0.01)
        assert (0.0 - b.last_event) == pytest.approx(1e5 - c.last_event + later, abs=0.01)


def test_the_file_is_versioned_and_a_bad_one_is_named() -> None:
    with pytest.raises(HealthStateError, match=r"format version 2; this plugin reads version 1"):
        decode('{"version": 2, "gpus": {}}', mono_now=0, wall_now=0)
    with pytest.raises(HealthStateError, match="not JSON"):
        decode("{", mono_now=0, wall_now=0)
    with pytest.raises(HealthStateError, match="GPU GPU-1: bad entry"):
        decode('{"version": 1, "gpus": {"GPU-1": {"severity": "sick"}}}', mono_now=0, wall_now=0)
    # Fields a newer writer adds within version 1 are ignored.
    doc = json.loads(encode({"GPU-1": _fatal()}, mono_now=5, wall_now=10))
    doc["gpus"]["GPU-1"]["newField"] = 1
    assert decode(json.dumps(doc), mono_now=5, wall_now=10).gpus["GPU-1"].value == "xid-79"


def test_an_instance_condition_keeps_its_place() -> None:
    one = Condition(Severity.DEGRADED, "xid-94", "XID 94 in GPU instance 3", 1.0, 2.0)
    text = encode(
        {},
        mono_now=5,
        wall_now=10,
        instances={("GPU-1", 3): one, ("GPU-1", 4): one},
        places={("GPU-1", 3): (19, 2)},  # instance 4's place unknown: not saved
    )
    back = decode(text, mono_now=5, wall_now=10)
    assert back.gpus == {} and back.instances == {("GPU-1", 3): one}
    assert back.places == {("GPU-1", 3): (19, 2)}
    with pytest.raises(HealthStateError, match="instance GPU-1/x: bad entry"):
        decode(text.replace("GPU-1/3", "GPU-1/x"), mono_now=0, wall_now=0)


def _fatal() -> Condition:
    return Condition(Severity.FATAL, "xid-79", "XID 79", since=1.0, last_event=2.0)


def test_an_unreadable_file_is_logged_and_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = HealthStateFile(tmp_path / "gpu-health.json")
    assert state.load() == SavedHealth()  # none yet
    state.save({"GPU-1": _fatal()})
    assert state.load().gpus["GPU-1"].severity is Severity.FATAL
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-health.json"]  # no temp file left
    (tmp_path / "gpu-health.json").write_text("garbage")
    with caplog.at_level(logging.WARNING):
        assert state.load() == SavedHealth()
    assert "ignoring the GPU health file" in caplog.text
