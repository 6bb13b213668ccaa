"""Nodes whose kubelet plugin speaks a carve contract version out of range are told, never
misread (issue 42.1; the rule and the bump rules are in docs/architecture.md, Version skew).

Each plugin labels its ResourceSlices with the contract version it speaks
(`Contract.contract_version_key`). The controller and a plugin may be one version apart in
either direction (`driver.contract.CONTRACT_SKEW`); further apart, the controller does not read
that node's slices at all (`EnginePlanner.contract_skew`), so it places nothing there, and
claims already allocated there keep their holds. This module tells the operator: a Warning
event `ContractSkew` on the Node (repeated every `event_interval` while it lasts, since events
expire), a log line when it appears and when it ends, and the gauge
`carve_contract_skew_nodes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from controller.model import GpuInventory, inventories_from_slices
from controller.objects import Kind
from controller.reminders import Reminders
from controller.seams import Metrics, Recorder
from controller.tolerations import DeviceTaint
from driver import contract
from driver.apiviews import ObjectView
from process.kube import Obj

_log = logging.getLogger(__name__)


class NodeSkew:
    """The planner's reading of one node's slices: none at all when they declare a contract
    version out of range (`skewed` says why), else the GPUs they publish."""

    def __init__(self, driver: str) -> None:
        self._driver = driver
        self._key = contract.Contract(driver).contract_version_key
        self.skewed: dict[str, str] = {}  # node -> why its slices are not read

    def inventories(
        self,
        node: str,
        slices: Mapping[str, Obj],
        rule_taints: Callable[[str, str], tuple[DeviceTaint, ...]],
    ) -> list[GpuInventory]:
        """`node`'s GPUs from its slices (name -> slice), [] while it is skewed: never misread,
        its GPUs leave the model as when its plugin deletes its slices (holds stay)."""
        why = self.why(node, slices)
        if why:
            if self.skewed.get(node) != why:
                _log.warning("not placing on node %s: %s", node, why)
            self.skewed[node] = why
            return []
        self.skewed.pop(node, None)
        errors: list[str] = []
        inventories = inventories_from_slices(
            slices.values(),
            self._driver,
            on_error=lambda e: errors.append(str(e)),
            rule_taints=rule_taints,
        )
        if errors:
            _log.warning("node %s publishes malformed slices: %s", node, "; ".join(errors))
        return inventories

    def why(self, node: str, slices: Mapping[str, Obj]) -> str:
        """Why `node`'s slices are not read, "" when they are: a slice that declares a contract
        version out of range, or one that cannot be read (the first, by slice name)."""
        for name, obj in sorted(slices.items()):
            where = f"ResourceSlice {name} (label {self._key})"
            try:
                label = ObjectView(obj).labels.get(self._key)
                theirs = contract.parse_contract_version(label, where=where)
            except contract.ContractSkewError as exc:
                return str(exc)
            why = contract.contract_skew(
                theirs, other=f"the carve kubelet plugin on node {node}", me="this controller"
            )
            if why:
                return f"{why} ({where})"
        return ""


class ContractSkewReporter:
    """Tells each skewed Node, the log and the metrics, as the set of skewed nodes changes."""

    def __init__(
        self,
        *,
        recorder: Recorder,
        metrics: Metrics,
        clock: Callable[[], float],
        interval: float,
    ) -> None:
        self._recorder = recorder
        self._metrics = metrics
        self._clock = clock
        # node -> why its slices are not read
        self._told: Reminders[str, str] = Reminders(interval)

    def report(self, skewed: Mapping[str, str]) -> None:
        """Call once per step with node -> why its slices are not read."""
        if not skewed and not self._told:
            return
        now = self._clock()
        for node, _ in self._told.ended(skewed):
            _log.info("node %s speaks a carve contract version in range again", node)
        for node, why in sorted(skewed.items()):
            if not self._told.due(node, why, now):
                continue
            message = f"carve places nothing on this node: {why}"
            self._recorder.event(
                {"metadata": {"name": node}}, Kind.NODE, "Warning", "ContractSkew", message
            )
        self._metrics.set_contract_skew(len(skewed))
