"""The steps every carve binary takes between `main()` and its domain objects.

Both binaries answer a usage error the same way (one line on stderr naming the binary, exit code
2, before anything is started or written), configure logging from the shared logging flags and
then report deprecated flag spellings as warnings (only then is there a log to report them to),
and stop on SIGTERM (the kubelet and the Deployment controller) and SIGINT (a terminal) alike.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Iterable

from process.logformat import configure_logging

EXIT_USAGE = 2

_log = logging.getLogger("carve.flags")


def usage_exit(prog: str, error: Exception) -> int:
    """Print `prog: error` on stderr; the exit code for a usage error."""
    print(f"{prog}: {error}", file=sys.stderr)
    return EXIT_USAGE


def start_logging(fmt: str, level: str, deprecations: Iterable[str] = ()) -> None:
    """Configure the root logger, then warn once about each deprecated spelling in use."""
    configure_logging(fmt, level)
    for note in deprecations:
        _log.warning(note, extra={"deprecated": True})


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call `stop` on SIGTERM or SIGINT; it must only set a flag (it runs in a signal handler)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
