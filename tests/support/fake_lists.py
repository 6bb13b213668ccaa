"""A JSON client that answers every list with an empty page and records what was asked:
enough to see which collections the controller lists, and how (tests of
`controller.informers.standard_informers`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EmptyLists:
    asked: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # path, query

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        assert method == "GET", (method, path)
        self.asked.append((path, dict(query)))
        return {"items": [], "metadata": {"resourceVersion": "1"}}

    def stream(
        self, path: str, *, query: Sequence[tuple[str, str]] = (), timeout: float
    ) -> Iterator[str]:
        raise AssertionError("not watched in these tests")
