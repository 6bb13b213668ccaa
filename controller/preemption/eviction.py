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
from typing import Any, Protocol

from process.kube import Obj
from process.kube.errors import status_of


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
    """`Evictor` with the official client; ``fence`` is checked before every eviction."""

    def __init__(
        self, core_api: Any, policy_api: Any, *, fence: Callable[[], bool] = lambda: True
    ) -> None:
        self._core = core_api
        self._policy = policy_api
        self._fence = fence

    def evict(self, pod: Obj, *, dry_run: bool) -> EvictionResult:
        from kubernetes.client.exceptions import ApiException

        if not self._fence():
            raise EvictionFencedError("not the leader any more")
        meta = pod["metadata"]
        options: Obj = {"preconditions": {"uid": meta["uid"]}}
        if dry_run:
            options["dryRun"] = ["All"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "deleteOptions": options,
        }
        try:
            self._core.create_namespaced_pod_eviction(
                meta["name"], meta["namespace"], body, _preload_content=False
            )
        except ApiException as exc:
            text = _message(exc.body, str(exc.reason))
            if exc.status == 429:
                return EvictionResult(EvictionOutcome.BLOCKED, text)
            if exc.status in (404, 409):
                return EvictionResult(EvictionOutcome.GONE, text)
            raise
        return EvictionResult(EvictionOutcome.EVICTED)

    def disruption_budgets(self, namespace: str) -> list[Obj]:
        resp = self._policy.list_namespaced_pod_disruption_budget(namespace, _preload_content=False)
        items: list[Obj] = json.loads(resp.data).get("items") or []
        return items
