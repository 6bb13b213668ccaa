"""Every API request a process sends, counted at the one seam they all pass.

Every generated method of the Kubernetes client (and the watch helper, and a raw `call_api`)
ends in its `ApiClient`'s `rest_client.request(method, url, ...)`. Wrapping that one object
counts all of them, whoever sends them (informers, writers, the leader elector, eviction),
with nothing to remember at each call site, and works on any `ApiClient` subclass.

A request is named as the apiserver's own metrics name it: the verb (`get`, `list`, `watch`,
`create`, `update`, `patch`, `delete`, `deletecollection`), the resource with its subresource
(`pods/status`, `resourceclaims`), and the outcome: the HTTP status code, or `no-answer` when
the request got none (a broken link, a timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

Record = Callable[[str, str, str], None]
"""`(verb, resource, outcome)`: count one request."""

NO_ANSWER = "no-answer"

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def request_name(method: str, url: str) -> tuple[str, str]:
    """(verb, resource) of one request, as kube-apiserver's request metrics name them."""
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if segments[:1] == ["api"]:
        segments = segments[2:]
    elif segments[:1] == ["apis"]:
        segments = segments[3:]
    else:
        return method.lower(), "nonresource"
    if len(segments) > 2 and segments[0] == "namespaces":
        segments = segments[2:]  # a namespaced resource; `namespaces/<ns>` alone is the namespace
    if not segments:
        return method.lower(), "nonresource"
    resource = segments[0] if len(segments) < 3 else f"{segments[0]}/{segments[2]}"
    named = len(segments) > 1
    method = method.upper()
    if method == "GET":
        query = parse_qs(parts.query)
        if query.get("watch", ["false"])[0] in ("true", "1"):
            return "watch", resource
        return ("get" if named else "list"), resource
    if method == "DELETE" and not named:
        return "deletecollection", resource
    return _VERBS.get(method, method.lower()), resource


class _CountingRest:
    """A `rest_client` that counts each request, then answers as the one it wraps."""

    def __init__(self, inner: Any, record: Record) -> None:
        self._inner = inner
        self._record = record

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        verb, resource = request_name(method, url)
        try:
            response = self._inner.request(method, url, *args, **kwargs)
        except Exception:
            self._record(verb, resource, NO_ANSWER)
            raise
        self._record(verb, resource, str(getattr(response, "status", NO_ANSWER)))
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def count_requests(api_client: Any, record: Record) -> Any:
    """Count every request `api_client` sends from now on with `record`; returns the client."""
    if not isinstance(api_client.rest_client, _CountingRest):
        api_client.rest_client = _CountingRest(api_client.rest_client, record)
    return api_client
