"""An apiserver's events.k8s.io/v1 collection in memory, behind the JSON client's `request`:
what `process.kube.events.EventWriter` writes to, in the unit tests of both programs.

POST creates (409 when the name exists, as the apiserver answers), a merge PATCH of an
existing Event updates it (404 when there is none). `fail` makes every request raise.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from process.kube.errors import api_error

_PREFIX = "/apis/events.k8s.io/v1/namespaces/"


@dataclass
class FakeEventsApi:
    events: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, type
    fail: Exception | None = None

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        self.requests.append((method, path, content_type))
        if self.fail is not None:
            raise self.fail
        assert path.startswith(_PREFIX), path
        namespace, _, *rest = path[len(_PREFIX) :].split("/")
        if method == "POST":
            key = (namespace, body["metadata"]["name"])
            if key in self.events:
                raise api_error(409, f'events.events.k8s.io "{key[1]}" already exists')
            self.events[key] = copy.deepcopy(body)
            return copy.deepcopy(body)
        if method == "PATCH":
            (name,) = rest
            assert content_type == "application/merge-patch+json", content_type
            event = self.events.get((namespace, name))
            if event is None:
                raise api_error(404, f'events.events.k8s.io "{name}" not found')
            event.update(copy.deepcopy(body))
            return copy.deepcopy(event)
        raise AssertionError(f"unexpected {method} {path}")

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events.values()]
