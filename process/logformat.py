"""Log output shared by every carve process, so one parser reads all of them.

JSON lines carry `ts` (ISO-8601, UTC), lower-case `level`, `logger`, `msg`, every `extra`
field the call site attached (claim, pod, node, GPU, ...) as a top-level key, and `exc` with
the traceback when there is one.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(fmt: str, level: str) -> None:
    """Send the root logger to stderr as `json` lines or plain `text`, at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
