"""Evicting pods through the Eviction API (policy/v1 ``pods/eviction``) and reading PDBs.

The Eviction API, not a plain delete, because it is where kube-apiserver enforces
PodDisruptionBudgets: a pod whose budget allows no disruption is refused with 429 Too Many
Requests, whatever the caller believes the budget's status to be. carve first sends every
eviction of a set as a dry run, so a refusal is found before any pod of the set is gone.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from driver.apiviews import ObjectView
from process.kube import Obj
from process.kube.errors import ApiError, status_of
from process.kube.jsonclient import JsonRequests


class EvictionOutcome(enum.Enum):
    EVICTED = "evicted"
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget forbids it now
    GONE = "gone"  # 404, or the pod was replaced (uid precondition failed)


@dataclass(frozen=True)
class EvictionResult:
    outcome: EvictionOutcome
    message: str = ""


class Evictor(Protocol):
    def evict(self, pod: Obj, *, dry_run: bool) -> EvictionResult: ...

    def disruption_budgets(self, namespace: str) -> list[Obj]: ...


class EvictionFencedError(RuntimeError):
    """This replica is not the leader any more: it must not evict."""


def _message(body: object, fallback: str) -> str:
    if isinstance(body, (str, bytes)) and body:
        try:
            return str(json.loads(body).get("message") or fallback)
        except (ValueError, AttributeError):
            return str(body)
    return fallback


def describe_failure(exc: BaseException) -> str:
    """An unexpected Eviction API error in words for the pod's event (403 names the missing
    permission, which is what an operator has to fix)."""
    status = status_of(exc)
    text = _message(getattr(exc, "body", None), str(getattr(exc, "reason", "") or exc))
    return f"the Eviction API answered {status}: {text}" if status else str(exc)


class KubeEvictor:
    """`Evictor` through the JSON client; ``fence`` is checked before every eviction."""

    def __init__(self, api: JsonRequests, *, fence: Callable[[], bool] = lambda: True) -> None:
        self._api = api
        self._fence = fence

    def evict(self, pod: Obj, *, dry_run: bool) -> EvictionResult:
        if not self._fence():
            raise EvictionFencedError("not the leader any more")
        view = ObjectView(pod)
        options: Obj = {"preconditions": {"uid": view.uid}}
        if dry_run:
            options["dryRun"] = ["All"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": view.name, "namespace": view.namespace},
            "deleteOptions": options,
        }
        path = f"/api/v1/namespaces/{view.namespace}/pods/{view.name}/eviction"
        try:
            self._api.request("POST", path, body=body)
        except ApiError as exc:
            text = _message(exc.body, str(exc))
            if exc.status == 429:
                return EvictionResult(EvictionOutcome.BLOCKED, text)
            if exc.status in (404, 409):
                return EvictionResult(EvictionOutcome.GONE, text)
            raise
        return EvictionResult(EvictionOutcome.EVICTED)

    def disruption_budgets(self, namespace: str) -> list[Obj]:
        page = self._api.request(
            "GET", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
        )
        items: list[Obj] = page.get("items") or []
        return items
