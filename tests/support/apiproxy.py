"""A real HTTP proxy between a client and kube-apiserver that can misbehave on cue.

Two ways to stand in the middle:

- as the admin (the default): the client talks plain HTTP to the proxy (a kubeconfig without
  credentials); the proxy forwards every request over TLS with the cluster's admin
  credentials;
- as the client (`as_client=True`): the proxy terminates the client's TLS with a certificate
  of its own CA and forwards each request with the client's own bearer token and no
  credentials of its own, so the apiserver authenticates, authorizes and admits the client
  itself (a service-account token bound to a pod keeps its pod name: what the leader fence
  reads). A request held until after the client died still reaches the apiserver as that
  client's.

Either way the answer is streamed back, watches included (chunked). Faults, each armed by
the test:

- `drop_response(match)`: forward the next request that `match(method, path, body)` accepts,
  let the apiserver apply it, read its answer, then close the client's connection without a
  byte: the client sees a reset after the write landed (an ambiguous write);
- `hold(match)`: forward nothing of a matching request (or of a matching watch's stream)
  until the returned `Hold` is released: a write in flight, or a watch that lags. What the
  apiserver answered a held request is kept on the `Hold` (`answers`), whether or not the
  client is still there to read it.

Test tooling only: nothing shipped imports it.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import queue
import socket
import ssl
import sys
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
    answers: list[Answer] = field(default_factory=list)  # the apiserver's, once released

    def release(self) -> None:
        self.released.set()


@dataclass(frozen=True)
class Answer:
    """What the apiserver answered one held request (not a watch)."""

    request: str  # "METHOD path"
    status: int
    body: bytes


@dataclass
class _Faults:
    lock: threading.Lock = field(default_factory=threading.Lock)
    drop: list[Match] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    seen: list[tuple[str, str]] = field(default_factory=list)


class _ClientGoneError(Exception):
    """The client left during the TLS handshake: a controller killed while connecting."""


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-handshake is what these tests do to clients, not a fault of the
        proxy: no traceback for it. Anything else is printed as usual."""
        if isinstance(sys.exc_info()[1], _ClientGoneError):
            return
        super().handle_error(request, client_address)


class ApiProxy:
    """See the module docstring. Use as a context manager."""

    def __init__(self, kubeconfig: Path, *, as_client: bool = False) -> None:
        doc = yaml.safe_load(kubeconfig.read_text())
        cluster = doc["clusters"][0]["cluster"]
        user = doc["users"][0]["user"]
        target = urlsplit(cluster["server"])
        self._host, self._port = target.hostname or "127.0.0.1", target.port or 443
        self._dir = Path(tempfile.mkdtemp(prefix="carve-apiproxy-"))
        ca = self._dir / "ca.crt"
        ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
        self._tls = ssl.create_default_context(cafile=str(ca))
        self.as_client = as_client
        if not as_client:
            for name, key in (
                ("client.crt", user["client-certificate-data"]),
                ("client.key", user["client-key-data"]),
            ):
                (self._dir / name).write_bytes(base64.b64decode(key))
            self._tls.load_cert_chain(str(self._dir / "client.crt"), str(self._dir / "client.key"))
        self.faults = _Faults()
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._serving_ca: Path | None = None
        if as_client:
            self._serving_ca = self._serve_tls()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ApiProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()
        self._server.shutdown()
        self._server.server_close()

    def _serve_tls(self) -> Path:
        """Terminate the client's TLS: a CA of the proxy's own (the client trusts it through
        its kubeconfig) and a serving certificate for 127.0.0.1. The handshake is made in the
        connection's own thread (`Handler.setup`), so a client that dies mid-handshake never
        stalls the accepting one."""
        from devcluster.pki import CertificateAuthority

        authority = CertificateAuthority.create("carve-apiproxy-ca")
        ca = authority.write(self._dir, "serving-ca")
        serving = authority.issue(
            self._dir, "serving", common_name="carve-apiproxy", ip_addresses=["127.0.0.1"],
            server=True,
        )  # fmt: skip
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(str(serving.cert), str(serving.key))
        self._server.socket = tls.wrap_socket(
            self._server.socket, server_side=True, do_handshake_on_connect=False
        )
        return ca.cert

    @property
    def url(self) -> str:
        scheme = "https" if self.as_client else "http"
        return f"{scheme}://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """A kubeconfig that reaches the apiserver through this proxy: with `as_client`, over
        TLS (trusting the proxy's CA) with `token`, the client's own credential."""
        cluster: dict[str, str] = {"server": self.url}
        user: dict[str, str] = {}
        if self._serving_ca is not None:
            cluster["certificate-authority-data"] = base64.b64encode(
                self._serving_ca.read_bytes()
            ).decode()
            assert token, "a proxy that forwards the client's credentials needs one"
            user["token"] = token
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "proxy", "cluster": cluster}],
                    "users": [{"name": "proxy", "user": user}],
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

            def setup(self) -> None:
                if isinstance(self.request, ssl.SSLSocket):
                    self.request.settimeout(30)
                    try:
                        self.request.do_handshake()
                    except OSError as exc:  # ssl.SSLError included
                        raise _ClientGoneError(str(exc)) from exc
                    self.request.settimeout(None)
                super().setup()

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
                    for held in holds:
                        held.answers.append(Answer(f"{method} {path}", resp.status, data))
                    self.send_header("Content-Length", str(len(data)))
                    try:
                        self.end_headers()
                        self.wfile.write(data)
                    except OSError:  # the client is gone (killed while its request was held)
                        self.close_connection = True
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
