"""The one flag layer: precedence of flag, twin, conventional and deprecated variables; errors."""

from __future__ import annotations

import pytest

from process import flags
from process.flags import CommandLine, Flag, UsageError, parse_duration

PERIOD: Flag[float] = Flag(
    "period",
    "how often",
    "30s",
    parse_duration,
    example="30s",
    also_env=("PERIOD",),
    deprecated_flags=("period-seconds",),
    deprecated_env=("OLD_PERIOD",),
)
NAME: Flag[str] = Flag("name", "a name", "", flags.required, example="n1", also_env=("NAME",))
ON: Flag[bool] = Flag("on", "a switch", "false", flags.parse_bool, example="true", switch=True)
CMD = CommandLine("carve-test", "test binary", (PERIOD, NAME, ON))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1.5h", 5400.0), ("250ms", 0.25)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["five minutes", "", "-1s", "10d", "abc"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("argv", "env", "seconds", "deprecated"),
    [
        ([], {}, 30.0, ()),
        ([], {"OLD_PERIOD": "1"}, 1.0, ("OLD_PERIOD",)),
        ([], {"OLD_PERIOD": "1", "CARVE_PERIOD_SECONDS": "2"}, 2.0, ("CARVE_PERIOD_SECONDS",)),
        ([], {"CARVE_PERIOD_SECONDS": "2", "PERIOD": "3"}, 3.0, ()),
        ([], {"PERIOD": "3", "CARVE_PERIOD": "4"}, 4.0, ()),
        (["--period-seconds=5"], {"CARVE_PERIOD": "4"}, 5.0, ("--period-seconds",)),
        (["--period=6m", "--period-seconds=5"], {}, 360.0, ("--period-seconds",)),
    ],
)
def test_first_source_found_wins(
    argv: list[str], env: dict[str, str], seconds: float, deprecated: tuple[str, ...]
) -> None:
    got = CMD.parse(["--name=n", *argv], env)
    assert got[PERIOD] == seconds
    assert len(got.deprecations) == len(deprecated)
    for note, spelling in zip(got.deprecations, deprecated, strict=True):
        assert note.startswith(spelling) and "deprecated" in note


def test_an_empty_variable_is_a_value() -> None:
    """CARVE_HTTP_ADDRESS="" must disable the endpoints, not fall back to the default."""
    cmd = CommandLine("t", "", (flags.http_address(),))
    assert cmd.parse([], {"CARVE_HTTP_ADDRESS": ""}).values["http-address"] == ""
    assert cmd.parse([], {}).values["http-address"] == ":8080"


def test_switch() -> None:
    assert CMD.parse(["--name=n", "--on"], {})[ON] is True
    assert CMD.parse(["--name=n", "--on=off"], {"CARVE_ON": "yes"})[ON] is False
    assert CMD.parse(["--name=n"], {"CARVE_ON": "yes"})[ON] is True


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "--name is required; e.g. --name=n1, or set CARVE_NAME or NAME"),
        (
            ["--name=n", "--period=abc"],
            {},
            "--period='abc': not a duration (250ms, 30s, 5m or 1.5h); e.g. --period=30s",
        ),
        (["--name=n"], {"CARVE_PERIOD": "x"}, "CARVE_PERIOD='x' (--period): not a duration"),
        (["--name=n"], {"OLD_PERIOD": "x"}, "OLD_PERIOD='x' (--period)"),
        (["--name=n", "--period-seconds=x"], {}, "--period-seconds='x'"),
        (["--name=n", "--on=maybe"], {}, "--on='maybe': not a boolean"),
    ],
)
def test_bad_values_name_their_source_and_an_example(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError) as err:
        CMD.parse(argv, env)
    assert message in str(err.value)
    assert "; e.g. --" in str(err.value)


def test_unknown_flag_exits_2_like_argparse() -> None:
    with pytest.raises(SystemExit) as err:
        CMD.parse(["--nope"], {})
    assert err.value.code == 2


def test_a_spelling_is_declared_once() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        CommandLine("t", "", (PERIOD, Flag("period-seconds", "", "", str, example="x")))


def test_help_names_the_variables_and_the_default() -> None:
    text = CMD.parser().format_help()
    assert "[env CARVE_PERIOD / PERIOD] (default 30s)" in text
    assert "deprecated spelling of --period" in text


@pytest.mark.parametrize(
    ("text", "ok"),
    [("", True), (":8080", True), ("127.0.0.1:0", True), ("[::1]:9", True), ("8080", False)],
)
def test_http_address(text: str, ok: bool) -> None:
    if ok:
        assert flags.http_address_value(text) == text
    else:
        with pytest.raises(ValueError, match="host"):
            flags.http_address_value(text)
