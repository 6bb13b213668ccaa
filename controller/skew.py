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

from controller.objects import Kind
from controller.seams import Metrics, Recorder

_log = logging.getLogger(__name__)


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
        self._interval = interval
        self._told: dict[str, tuple[str, float]] = {}  # node -> why, when told

    def report(self, skewed: Mapping[str, str]) -> None:
        """Call once per step with node -> why its slices are not read."""
        if not skewed and not self._told:
            return
        now = self._clock()
        for node in [n for n in self._told if n not in skewed]:
            del self._told[node]
            _log.info("node %s speaks a carve contract version in range again", node)
        for node, why in sorted(skewed.items()):
            told = self._told.get(node)
            if told is not None and told[0] == why and now - told[1] < self._interval:
                continue
            message = f"carve places nothing on this node: {why}"
            self._recorder.event(
                {"metadata": {"name": node}}, Kind.NODE, "Warning", "ContractSkew", message
            )
            self._told[node] = (why, now)
        self._metrics.set_contract_skew(len(skewed))
