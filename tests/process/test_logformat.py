"""Every carve process logs one shape; a parser written for one reads all."""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys

from process.logformat import JsonFormatter


def _record(**extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("carve.x", logging.WARNING, __file__, 1, "claim %s", ("a/b",), None)
    rec.__dict__.update(extra)
    return rec


def test_json_line_has_iso_utc_ts_lowercase_level_and_all_extras() -> None:
    out = json.loads(JsonFormatter().format(_record(claim="a/b", gpu=object(), _private=1)))
    assert out["level"] == "warning" and out["logger"] == "carve.x" and out["msg"] == "claim a/b"
    assert dt.datetime.fromisoformat(out["ts"]).utcoffset() == dt.timedelta(0)
    assert out["claim"] == "a/b" and isinstance(out["gpu"], str)
    assert "_private" not in out and "exc" not in out and "args" not in out


def test_exception_traceback_goes_to_exc() -> None:
    try:
        raise ValueError("bad input")
    except ValueError:
        rec = logging.LogRecord("carve.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = json.loads(JsonFormatter().format(rec))
    assert out["level"] == "error" and "ValueError: bad input" in out["exc"]
