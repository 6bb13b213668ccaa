"""A real HTTP proxy between a client and kube-apiserver that can misbehave on cue.

The client talks plain HTTP to the proxy (a kubeconfig without credentials); the proxy
forwards every request over TLS with the cluster's admin credentials and streams the answer
back, watches included (chunked). Faults, each armed by the test:

- `drop_response(match)`: forward the next request that `match(method, path, body)` accepts,
  let the apiserver apply it, read its answer, then close the client's connection without a
  byte: the client sees a reset after the write landed (an ambiguous write);
- `hold(match)`: forward nothing of a matching request (or of a matching watch's stream)
  until the returned `Hold` is released: a write in flight, or a watch that lags.

Test tooling only: nothing shipped imports it.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import queue
import socket
import ssl
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

Match = Callable[[str, str, bytes], bool]
"""(method, path with query, request body) -> whether the fault applies."""

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Hold:
    """Requests held back by `ApiProxy.hold` until `release()`."""

    match: Match
    released: threading.Event = field(default_factory=threading.Event)
    requests: list[str] = field(default_factory=list)  # "METHOD path" of each one held

    def release(self) -> None:
        self.released.set()


@dataclass
class _Faults:
    lock: threading.Lock = field(default_factory=threading.Lock)
    drop: list[Match] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)


class ApiProxy:
    """See the module docstring. Use as a context manager."""

    def __init__(self, kubeconfig: Path) -> None:
        doc = yaml.safe_load(kubeconfig.read_text())
        cluster = doc["clusters"][0]["cluster"]
        user = doc["users"][0]["user"]
        target = urlsplit(cluster["server"])
        self._host, self._port = target.hostname or "127.0.0.1", target.port or 443
        self._dir = Path(tempfile.mkdtemp(prefix="carve-apiproxy-"))
        files = {}
        for name, key in (
            ("ca.crt", cluster["certificate-authority-data"]),
            ("client.crt", user["client-certificate-data"]),
            ("client.key", user["client-key-data"]),
        ):
            path = self._dir / name
            path.write_bytes(base64.b64decode(key))
            files[name] = path
        self._tls = ssl.create_default_context(cafile=str(files["ca.crt"]))
        self._tls.load_cert_chain(str(files["client.crt"]), str(files["client.key"]))
        self.faults = _Faults()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ApiProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that reaches the apiserver through this proxy."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
                    "users": [{"name": "proxy", "user": {}}],
                    "contexts": [
                        {"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}
                    ],
                    "current-context": "proxy",
                }
            )
        )
        return path

    # -- faults --------------------------------------------------------------------------------

    def drop_response(self, match: Match) -> None:
        with self.faults.lock:
            self.faults.drop.append(match)

    def hold(self, match: Match) -> Hold:
        held = Hold(match)
        with self.faults.lock:
            self.faults.holds.append(held)
        return held

    def release_all(self) -> None:
        with self.faults.lock:
            for held in self.faults.holds:
                held.release()

    # -- forwarding ----------------------------------------------------------------------------

    def _upstream(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self._host, self._port, context=self._tls, timeout=600)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                method, path = self.command, self.path
                faults = proxy.faults
                with faults.lock:
                    faults.seen.append((method, path))
                    drop = next((m for m in faults.drop if m(method, path, body)), None)
                    if drop is not None:
                        faults.drop.remove(drop)
                    holds = [
                        h
                        for h in faults.holds
                        if not h.released.is_set() and h.match(method, path, body)
                    ]
                query = path.partition("?")[2].lower()
                watch = "watch=true" in query or "watch=1" in query
                for held in holds:
                    held.requests.append(f"{method} {path}")
                    if not watch:
                        held.released.wait()
                upstream = proxy._upstream()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                upstream.request(method, path, body=body or None, headers=headers)
                resp = upstream.getresponse()
                if drop is not None:
                    resp.read()
                    upstream.close()
                    faults.dropped.append(f"{method} {path}")
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_HEADERS:
                        self.send_header(k, v)
                if watch:
                    self._stream(resp, lambda: any(not h.released.is_set() for h in holds))
                else:
                    data = resp.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                upstream.close()

            def _stream(self, resp: http.client.HTTPResponse, holding: Callable[[], bool]) -> None:
                """A watch: pieces as they come, kept back while held (and let go at once
                when released, not with the next event)."""
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                pieces: queue.Queue[bytes] = queue.Queue()

                def read() -> None:
                    try:
                        while chunk := resp.read1(65536):
                            pieces.put(chunk)
                    except (OSError, ValueError, AttributeError, http.client.HTTPException):
                        pass  # the upstream connection was closed under the read
                    pieces.put(b"")

                threading.Thread(target=read, daemon=True).start()
                pending: list[bytes] = []
                ended = False
                try:
                    while not (ended and not pending):
                        with contextlib.suppress(queue.Empty):
                            chunk = pieces.get(timeout=0.1)
                            if chunk:
                                pending.append(chunk)
                            else:
                                ended = True
                        if pending and not holding():
                            for piece in pending:
                                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                            pending.clear()
                            self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward  # noqa: N815

        return Handler
