"""ResourceClaims as the node agent sees them, and the API calls it makes on them.

The kubelet's prepare request carries only namespace, name and UID, so the agent reads the claim
itself. Parsing is pure (`parse_claim` takes the JSON the apiserver returns) and produces a small
frozen view with exactly what preparation needs; the I/O lives in `KubernetesClaimClient`.

Node finalizer (DESIGN invariant 4): while a MIG instance exists for a claim on a node, the claim
carries `Contract.node_finalizer(node)` (`<driver>/node-<node name>`). The controller frees a
placement only once `reservedFor` is empty and no such finalizer remains.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from driver.allocation import AllocatedDevice, AllocationFormatError, parse_allocation
from driver.apiviews import ClaimView, ObjectView
from driver.config import OpaqueConfigEntry
from process.kube import Obj
from process.kube.errors import ConflictError, NotFoundError
from process.kube.events import EventWriter
from process.kube.finalizers import FinalizedObject, add_finalizer, remove_finalizer
from process.kube.jsonclient import JsonRequests, KubeJson
from process.kube.rmw import ObjectGoneError, WriteSkippedError

log = logging.getLogger(__name__)


class ClaimFormatError(ValueError):
    """The apiserver returned something that is not a ResourceClaim carve understands."""


@dataclass(frozen=True)
class ClaimSnapshot:
    """A claim as preparation reads it, copied out of the JSON when it was read (a frozen
    value, unlike `driver.apiviews.ClaimView`, which reads the live object)."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    deleting: bool
    finalizers: tuple[str, ...]
    allocated: bool
    results: tuple[AllocatedDevice, ...]
    config: tuple[OpaqueConfigEntry, ...]
    reserved_for: tuple[str, ...]  # "<resource>/<name>" of each consumer, for logs

    def results_for(self, driver: str) -> tuple[AllocatedDevice, ...]:
        return tuple(r for r in self.results if r.driver == driver)


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ClaimFormatError(f"{where}.{key} is missing or not a string")
    return value


def parse_claim(obj: Mapping[str, Any]) -> ClaimSnapshot:
    """Reduce an apiserver ResourceClaim object to a ClaimSnapshot."""
    if not isinstance(obj.get("metadata"), Mapping):
        raise ClaimFormatError("ResourceClaim has no metadata")
    view = ClaimView(obj)
    meta = view.metadata
    allocation = view.status.get("allocation") or None
    try:
        parsed = parse_allocation(allocation)
    except AllocationFormatError as exc:
        raise ClaimFormatError(str(exc)) from exc
    return ClaimSnapshot(
        namespace=_str(meta, "namespace", "metadata"),
        name=_str(meta, "name", "metadata"),
        uid=_str(meta, "uid", "metadata"),
        resource_version=view.resource_version,
        deleting=view.deleting,
        finalizers=tuple(view.finalizers),
        allocated=allocation is not None,
        results=parsed.results,
        config=parsed.config,
        reserved_for=tuple(
            f"{r.get('resource', '?')}/{r.get('name', '?')}" for r in view.reserved_for
        ),
    )


class ClaimClient(Protocol):
    """What the preparer needs from the API; the only seam tests may replace."""

    def get(self, namespace: str, name: str) -> ClaimSnapshot | None:
        """The claim, or None if it does not exist."""

    def add_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        """Add `finalizer` to the claim with this UID (no-op if present)."""

    def remove_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        """Remove `finalizer`; a missing claim, a different UID or an absent finalizer is fine."""

    def holding(self, finalizer: str) -> list[ClaimSnapshot]:
        """Every claim in the cluster that carries `finalizer` (a node's: the claims that node
        may have carved for, which is what a damaged checkpoint is rebuilt from)."""

    def apply_device_status(
        self, namespace: str, name: str, uid: str, manager: str, entries: Sequence[Obj]
    ) -> None:
        """Make `entries` (driver, pool, device, data) the `status.devices` entries that
        `manager` owns on the claim with this UID: server-side apply, so other writers' entries
        and fields stay, and an entry no longer given loses what `manager` wrote. A claim that
        is gone (or now another object) is fine; any other refusal raises ApiError."""


class ClaimGoneError(Exception):
    """The claim (with the expected UID) no longer exists."""


_ALL_CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; JSON is YAML


def _claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class KubernetesClaimClient:
    """ClaimClient over the apiserver (resource.k8s.io/v1)."""

    def __init__(self, api: KubeJson) -> None:
        self._api = api

    def get(self, namespace: str, name: str) -> ClaimSnapshot | None:
        try:
            return parse_claim(self._api.request("GET", _claim_path(namespace, name)))
        except NotFoundError:
            return None

    def _claim(self, namespace: str, name: str, uid: str) -> FinalizedObject:
        return FinalizedObject(self._api, _claim_path(namespace, name), namespace, name, uid)

    def add_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        """`process.kube.finalizers.add_finalizer`, the controller's way too: one strategic
        merge that adds the entry to whatever list the claim has, so it needs no read first."""
        try:
            add_finalizer(self._claim(namespace, name, uid), finalizer)
        except ObjectGoneError as e:
            raise ClaimGoneError(
                f"ResourceClaim {namespace}/{name} with UID {uid} no longer exists"
            ) from e
        except WriteSkippedError as e:
            raise ClaimGoneError(f"ResourceClaim {e}") from e

    def apply_device_status(
        self, namespace: str, name: str, uid: str, manager: str, entries: Sequence[Obj]
    ) -> None:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "status": {"devices": list(entries)},
        }
        # Gone (404), or another object under that name now (409): nothing to report on.
        with contextlib.suppress(NotFoundError, ConflictError):
            self._api.request(
                "PATCH",
                f"{_claim_path(namespace, name)}/status",
                body=body,
                query=[("fieldManager", manager), ("force", "true")],
                content_type=APPLY_PATCH,
            )

    def holding(self, finalizer: str) -> list[ClaimSnapshot]:
        out: list[ClaimSnapshot] = []
        token = ""
        while True:
            query = [("limit", "500"), *([("continue", token)] if token else [])]
            page = self._api.request("GET", _ALL_CLAIMS, query=query)
            for obj in page.get("items") or []:
                if ObjectView(obj).has_finalizer(finalizer):
                    out.append(parse_claim(obj))
            token = str(ObjectView(page).metadata.get("continue") or "")
            if not token:
                return out

    def remove_finalizer(self, namespace: str, name: str, uid: str, finalizer: str) -> None:
        """`process.kube.finalizers.remove_finalizer`: a read, then the entry removed where that
        read shows it; a claim gone or replaced meanwhile has nothing left to remove."""
        with contextlib.suppress(ObjectGoneError):
            remove_finalizer(self._claim(namespace, name, uid), finalizer)


class ClaimEvents(Protocol):
    """Events on claims, for `kubectl describe resourceclaim`; best effort, never raises."""

    def event(
        self, namespace: str, name: str, uid: str, *, type_: str, reason: str, message: str
    ) -> None:
        """Post an Event about the claim; a failure is logged, not raised."""


def plugin_component(driver: str) -> str:
    """The reporting controller of the node plugin's events: ``<driver>/kubelet-plugin``."""
    return f"{driver}/kubelet-plugin"


def plugin_event_writer(
    api: JsonRequests,
    *,
    driver: str,
    node: str,
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> EventWriter:
    """The writer of this node's plugin's Events (`process.kube.events`, shared with the
    controller): reported by ``<driver>/kubelet-plugin``, instance ``<that>-<node>``."""
    component = plugin_component(driver)
    return EventWriter(api, controller=component, instance=f"{component}-{node}", clock=clock)


class KubernetesClaimEvents:
    """ClaimEvents over the apiserver (events.k8s.io/v1)."""

    def __init__(
        self,
        api: JsonRequests,
        *,
        driver: str,
        node: str,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._writer = plugin_event_writer(api, driver=driver, node=node, clock=clock)

    def event(
        self, namespace: str, name: str, uid: str, *, type_: str, reason: str, message: str
    ) -> None:
        regarding = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "namespace": namespace,
            "name": name,
            "uid": uid,
        }
        self._writer.write(
            namespace, regarding, type_=type_, reason=reason, message=message, action="Prepare"
        )


def describe_results(results: Sequence[AllocatedDevice]) -> str:
    return ", ".join(f"{r.driver}:{r.pool}/{r.device}" for r in results) or "none"
