"""The plugin's side of the version-skew rule: it checks the contract version carve-controller
declares and refuses new prepares while it is out of range (issue 42.1; the rule and the bump
rules are in docs/architecture.md, Version skew).

carve-controller writes the contract version it speaks on its leader Lease (annotation
`Contract.contract_version_key`, with every renewal). The plugin reads that Lease at start and
with every housekeeping round (`--controller-lease`, `<namespace>/<name>`). Within one version
of its own it works as ever. Further apart it cannot trust the allocations that controller
writes, so it does not misread them: every NodePrepareResources answers an error naming both
versions (the kubelet retries, and a prepare succeeds once the versions are in range again),
while unprepare and everything already prepared go on, so no running pod loses its device. It
says so with a Warning event `ControllerContractSkew` on the Node when the verdict changes and
the gauge `carve_plugin_controller_contract_skew` (1 while refusing). The first read comes once the
plugin serves its sockets, so prepares that arrive before it are not refused.

Without a Lease (leader election off, a single controller replica) there is nothing to read:
the plugin logs that once and does not refuse; the controller's own check of the plugin's
slices (`controller.skew`) still holds. A Lease that cannot be read (the apiserver down) keeps
the last verdict.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from driver import contract
from driver.apiviews import ObjectView
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.nodeevents import NodeEvents
from process.kube.errors import status_of
from process.kube.jsonclient import JsonRequests

log = logging.getLogger(__name__)

REASON = "ControllerContractSkew"
_READ_TIMEOUT = 5.0  # seconds; an unanswered read keeps the last verdict until the next round


def parse_lease_ref(text: str) -> tuple[str, str]:
    """`<namespace>/<name>` of the controller's Lease; ValueError with an example otherwise."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(
            f"{text!r} is not <namespace>/<name> of carve-controller's Lease "
            "(e.g. carve-system/carve-controller)"
        )
    return namespace, name


class ControllerContract:
    """The last verdict on the controller's contract version; `poll` reads it again."""

    def __init__(
        self,
        api: JsonRequests,
        lease: tuple[str, str] | None,
        *,
        driver: str,
        events: NodeEvents,
        metrics: PluginMetrics,
    ) -> None:
        self._api = api
        self._lease = lease
        self._namespace, self._name = lease or ("", "")
        self._key = contract.Contract(driver).contract_version_key
        self._events = events
        self._metrics = metrics
        self._lock = threading.Lock()
        self._refusal = ""
        self._no_lease_told = False

    @classmethod
    def wired(cls, plugin: Any) -> ControllerContract:
        """The check of a `kubeletplugin.main.NodePlugin` (its --controller-lease, API, Node
        events and metrics), refusing its preparer's new prepares while out of range."""
        opts = plugin.opts
        check = cls(
            plugin.api,
            opts.controller_lease,
            driver=opts.driver_name,
            events=plugin.node_events,
            metrics=plugin.metrics,
        )
        plugin.preparer.contract_refusal = check.refusal
        return check

    def refusal(self) -> str:
        """Why prepares are refused now; "" while the controller is in range (or unknown)."""
        with self._lock:
            return self._refusal

    def poll(self) -> None:
        """Read the Lease again and act on a changed verdict; never raises (without a Lease
        flag, does nothing)."""
        if self._lease is None:
            return
        try:
            self._poll()
        except Exception:
            log.exception("checking carve-controller's contract version failed")

    def _poll(self) -> None:
        where = f"Lease {self._namespace}/{self._name} (annotation {self._key})"
        path = f"/apis/coordination.k8s.io/v1/namespaces/{self._namespace}/leases/{self._name}"
        try:
            lease = self._api.request("GET", path, timeout=_READ_TIMEOUT)
        except Exception as exc:
            if status_of(exc) == 404:
                if not self._no_lease_told:
                    log.info(
                        "no carve-controller Lease to read its contract version from (leader "
                        "election off?); not checking it",
                        extra={"lease": f"{self._namespace}/{self._name}"},
                    )
                    self._no_lease_told = True
                self._set("")
                return
            log.warning(
                "reading carve-controller's contract version failed; keeping the last verdict",
                extra={"lease": f"{self._namespace}/{self._name}", "error": str(exc)},
            )
            return
        self._no_lease_told = False
        try:
            theirs = contract.parse_contract_version(
                ObjectView(lease).annotations.get(self._key), where=where
            )
        except contract.ContractSkewError as exc:
            self._set(str(exc))
            return
        why = contract.contract_skew(
            theirs, other=f"carve-controller ({where})", me="this kubelet plugin"
        )
        self._set(why)

    def _set(self, refusal: str) -> None:
        with self._lock:
            changed, self._refusal = refusal != self._refusal, refusal
        self._metrics.controller_contract_skew.set(1 if refusal else 0)
        if not changed:
            return
        if refusal:
            message = f"this node prepares no new claim: {refusal}"
            log.error("controller contract out of range", extra={"error": message})
            self._events.event(
                type_="Warning", reason=REASON, message=message, action="CheckControllerContract"
            )
        else:
            log.info("carve-controller's contract version is in range again; preparing claims")
