"""A stand-in apiserver that can be slow on cue, for the node agent's start-up tests.

Plain HTTP on 127.0.0.1 (a kubeconfig with `http://` needs no TLS), just enough of the API for
a plugin started with `--no-publish`: `/version`, a Node that does not exist (events then name
the node by its name), Events accepted, and every ResourceClaim absent (404), so housekeeping
releases every prepared claim it reads. Until `answer()` is called, each request is held
without a byte of answer, the way an overloaded or half-dead apiserver behaves: the client
times out, and the test sees how long the plugin's start-up waits for it.

Test tooling only: nothing shipped imports it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

_VERSION = {"major": "1", "minor": "37", "gitVersion": "v1.37.2"}


class StubApiserver:
    """Holds every request until `answer()`; `requests` lists "METHOD path" as they arrive."""

    def __init__(self, *, answering: bool = False, delay: float = 0.0) -> None:
        """`delay`: seconds every answer waits once answering (a slow apiserver)."""
        self.requests: list[str] = []
        self._delay = delay
        self._answering = threading.Event()
        if answering:
            self._answering.set()
        self._closed = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def answer(self) -> None:
        """From now on (held requests included) answer instead of holding."""
        self._answering.set()

    def close(self) -> None:
        self._closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": self.url}}],
                    "users": [{"name": "u", "user": {"token": "x"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        return path

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                stub.requests.append(f"{self.command} {self.path}")
                while not stub._answering.wait(0.1):
                    if stub._closed.is_set():
                        return
                if stub._closed.wait(stub._delay):
                    return
                path = self.path.split("?")[0]
                if path == "/version":
                    code, body = 200, _VERSION
                elif self.command == "POST":
                    code, body = 201, {}
                else:
                    code, body = 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
                data = json.dumps(body).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    self.close_connection = True  # the client gave up waiting: its timeout

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve  # noqa: N815

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
