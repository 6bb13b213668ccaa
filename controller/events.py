"""Events on pods and claims, so `kubectl describe` tells users what carve decided and why.

The controller's `Recorder`: it names the object it is told about (a pod or a claim, as the
informers hold it) and hands the Event to `process.kube.events.EventWriter`, the one writer
both programs use (events.k8s.io/v1, best effort, repeats folded into one series).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from controller.objects import Kind
from driver.apiviews import ObjectView
from driver.contract import DEFAULT_CONTRACT
from process.kube import Obj
from process.kube.events import EventWriter, regarding_of
from process.kube.jsonclient import JsonRequests

_API_VERSIONS = {
    Kind.POD: "v1",
    Kind.CLAIM: "resource.k8s.io/v1",
}


class KubeRecorder:
    """`Recorder` writing to the apiserver through the JSON client."""

    def __init__(
        self,
        api: JsonRequests,
        *,
        controller: str = DEFAULT_CONTRACT.event_source,
        instance: str = "carve-controller",
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._writer = EventWriter(api, controller=controller, instance=instance, clock=clock)

    def event(self, obj: Obj, kind: Kind, type_: str, reason: str, message: str) -> None:
        regarding = regarding_of(obj, _API_VERSIONS.get(kind, "v1"), str(kind))
        self._writer.write(
            ObjectView(obj).namespace or "default",
            regarding,
            type_=type_,
            reason=reason,
            message=message,
            action="Allocate" if kind is Kind.CLAIM else "Place",
        )
