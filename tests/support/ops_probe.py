"""Reading a carve process's ops endpoints the way a probe does, for tests that wait on them."""

from __future__ import annotations

import urllib.error
import urllib.request


def readyz(port: int) -> tuple[int, str]:
    """(status, body) of 127.0.0.1:`port`/readyz; (0, "") while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, str(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, str(e.read().decode())
    except OSError:
        return 0, ""
