"""JSON in, JSON out: the one HTTP client both programs use for the Kubernetes API.

It rides on the official client's transport (kubeconfig or in-cluster auth, TLS) and nothing
else of it: the generated models validate strictly and lag behind the API, so raw JSON keeps a
field added by a newer apiserver from breaking carve, and a refusal becomes the typed error of
`process.kube.errors` for its status.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from process.kube.errors import api_error


class JsonRequests(Protocol):
    """The request half of `KubeJson`: what a writer needs, and the seam tests fake."""

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> dict[str, Any]: ...


class LineStream(Protocol):
    """An open streamed response: iterate for its lines; `close` ends it from any thread."""

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None: ...


class JsonApi(JsonRequests, Protocol):
    """`KubeJson` as a list-and-watch needs it: requests and streamed watches."""

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]] = (), timeout: float
    ) -> LineStream: ...


class SharedDeadlineError(TimeoutError):
    """A request was not sent: the calling thread's shared deadline (`calls_within`) had passed."""


_SHARED_DEADLINE = threading.local()


@contextmanager
def calls_within(seconds: float, what: str) -> Iterator[None]:
    """Every `KubeJson.request` this thread makes inside the block shares one deadline,
    `seconds` from now: each is given at most the time left (shared among its tries), and once
    none is left a request raises SharedDeadlineError without being sent.

    For work whose API calls are a side matter but which something else waits for (the node
    agent's start-up reconcile, which the kubelet's registration waits for): a slow apiserver
    then costs that work `seconds` in all, however many calls it makes, instead of the client's
    timeout per call. Thread-local, so the process's other threads are unaffected."""
    previous = getattr(_SHARED_DEADLINE, "current", None)
    _SHARED_DEADLINE.current = (time.monotonic() + seconds, seconds, what)
    try:
        yield
    finally:
        _SHARED_DEADLINE.current = previous


def _time_left(method: str, path: str) -> float | None:
    """Seconds left of this thread's shared deadline (None: there is none)."""
    current: tuple[float, float, str] | None = getattr(_SHARED_DEADLINE, "current", None)
    if current is None:
        return None
    end, seconds, what = current
    left = end - time.monotonic()
    if left <= 0:
        raise SharedDeadlineError(
            f"{method} {path} not sent: {what} gives the apiserver {seconds:g}s in all, spent"
        )
    return left


class KubeJson:
    """Calls through an official `ApiClient`'s transport; every call has a timeout, so a
    half-open connection cannot hang its caller."""

    def __init__(self, api_client: Any, *, request_timeout: float = 10.0) -> None:
        self._client = api_client
        self._timeout = request_timeout
        # urllib3 gives every try the whole timeout: within a shared deadline each try gets
        # its share, so the deadline holds with the retries (None is urllib3's default, 3).
        retries = getattr(getattr(api_client, "configuration", None), "retries", None)
        self._tries = 1 + (3 if retries is None else retries if isinstance(retries, int) else 0)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One request; `timeout` (seconds) replaces the client's own for this call. Inside
        `calls_within` it is cut so that the request ends, retries included, by the time left
        there."""
        limit = self._timeout if timeout is None else timeout
        left = _time_left(method, path)
        if left is not None:
            limit = min(limit, left / self._tries)
        m, url, headers, payload, _ = self._client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query) or None,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self._client.call_api(
            m,
            url,
            header_params=headers,
            body=payload,
            _request_timeout=limit,
        )
        data = resp.read() or b""
        text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        if not 200 <= resp.status < 300:
            raise api_error(resp.status, text)
        result: dict[str, Any] = json.loads(text) if text else {}
        return result

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]] = (), timeout: float
    ) -> LineStream:
        """A streamed response (a watch), opened now: its lines as they arrive, until the
        server ends it, `timeout` passes without a byte, or another thread closes it."""
        m, url, headers, payload, _ = self._client.param_serialize(
            method="GET",
            resource_path=path,
            query_params=list(query) or None,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        resp = self._client.call_api(
            m, url, header_params=headers, body=payload, _request_timeout=(10, timeout)
        )
        raw = resp.response
        if not 200 <= resp.status < 300:
            try:
                raise api_error(resp.status, raw.read().decode(errors="replace"))
            finally:
                raw.release_conn()
        return _RawLines(raw)


def split_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Newline-delimited text (a watch's JSON events) from chunks as a stream delivers them."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            yield line.decode("utf-8", errors="replace")
    if buffer.strip():
        yield buffer.decode("utf-8", errors="replace")


class _RawLines:
    """The lines of an open urllib3 response; `close` may come from another thread (a
    stopping watch), which ends the read blocked on the socket."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __iter__(self) -> Iterator[str]:
        try:
            yield from split_lines(self._raw.stream(amt=None, decode_content=False))
        finally:
            self._raw.release_conn()

    def close(self) -> None:
        shutdown = getattr(self._raw, "shutdown", None)
        (shutdown or self._raw.close)()
