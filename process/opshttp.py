"""/healthz, /readyz and /metrics, served the same way by every carve process.

Liveness (/healthz) says that the process can answer and, with `liveness` checks, that its
own work still makes progress (the controller's decision loop): restarting a component because
the apiserver is down would not help, so no check of another component's belongs there.
Readiness (/readyz) reports each check by name, so
`curl /readyz` tells an operator what is wrong (for the node agent: kubelet registration,
apiserver reachability, start-up reconcile, ResourceSlice publication; for the controller:
informer sync). One implementation keeps probes, scrape content type and query-string handling
identical across components.

A *report* is shown in /readyz without counting: `[!]name reason` while it has something to say,
`[+]name ok` otherwise. It is for what the operator must see but what does not stop the
component from serving (for the node agent: a lost GPU, while it serves the node's others), so
that a rollout gated on readiness does not stall on it.

The checks may be handed over once the component is assembled (`set_checks`): a process serves
/healthz from its first second, with a start-up check saying what it is still doing, and its
full set of checks once it has them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

ReadinessCheck = Callable[[], str]
"""Returns "" when ready, else a short reason."""


class OpsServer:
    def __init__(
        self,
        address: str,
        registry: CollectorRegistry,
        checks: Mapping[str, ReadinessCheck],
        *,
        reports: Mapping[str, ReadinessCheck] | None = None,
        liveness: Mapping[str, ReadinessCheck] | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        self._registry = registry
        self._liveness = dict(liveness or {})
        self._checks = dict(checks)
        self._reports = dict(reports or {})
        handler = self._handler()
        self._httpd = ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler)
        self._httpd.daemon_threads = True
        self._serving = False

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def set_checks(
        self,
        checks: Mapping[str, ReadinessCheck],
        reports: Mapping[str, ReadinessCheck] | None = None,
    ) -> None:
        """Replace the checks and reports (a probe already answering keeps its old set)."""
        self._checks, self._reports = dict(checks), dict(reports or {})

    def readiness(self) -> dict[str, str]:
        return _run(self._checks)

    def reports(self) -> dict[str, str]:
        """Each report's text ("" when it has nothing to say); none of them counts."""
        return _run(self._reports)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/healthz":
                    stuck = {n: r for n, r in _run(server._liveness).items() if r}
                    if stuck:
                        text = "".join(f"[-]{n} {r}\n" for n, r in stuck.items())
                        self._send(503, text.encode())
                    else:
                        self._send(200, b"ok\n")
                elif path == "/readyz":
                    results = server.readiness()
                    lines = [
                        f"[{'+' if not r else '-'}]{n} {r or 'ok'}" for n, r in results.items()
                    ]
                    lines += [
                        f"[{'!' if r else '+'}]{n} {r or 'ok'}" for n, r in server.reports().items()
                    ]
                    ready = all(not r for r in results.values())
                    text = "\n".join(lines) + ("\nreadyz check passed\n" if ready else "\n")
                    self._send(200 if ready else 503, text.encode())
                elif path == "/metrics":
                    self._send(200, generate_latest(server._registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found\n")

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http %s", format % args)

        return Handler

    def start(self) -> None:
        if self._serving:
            return
        self._serving = True
        threading.Thread(target=self._httpd.serve_forever, name="ops-http", daemon=True).start()
        log.info("serving /healthz, /readyz, /metrics", extra={"port": self.port})

    def stop(self) -> None:
        # shutdown() waits for serve_forever() to acknowledge: it would block forever on a
        # server that was never started (e.g. a start-up that failed after binding the port).
        if self._serving:
            self._httpd.shutdown()
            self._serving = False
        self._httpd.server_close()


def _run(checks: Mapping[str, ReadinessCheck]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception as e:  # a failing check is "not ready", never a crash
            out[name] = f"check failed: {e}"
    return out
