"""GPU UUIDs that two nodes publish are told, never silently resolved (issue 41.3).

A GPU UUID names one physical GPU, so the model counts it on the node that published it first
and ignores any other node's publication of it (`ClusterModel.duplicate_gpus`). Before, the
newer publication won: a plugin that published another node's UUIDs (a copied node image with a
baked-in simulator config, a wrong --node-name, or a compromised node) removed that node's GPUs
from carve's picture until the victim published again. Ignoring the duplicate keeps the first
node whole; telling both nodes gives the operator what to look at: a Warning event
`DuplicateGpuUuid` on each Node (repeated every `event_interval` while it lasts, since events
expire), a log line when it appears and when it ends, and the gauge `carve_duplicate_gpus`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from controller.objects import Kind
from controller.reminders import Reminders
from controller.seams import Metrics, Recorder

_log = logging.getLogger(__name__)


class DuplicateGpuReporter:
    """Tells both nodes, the log and the metrics about GPU UUIDs two nodes publish."""

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
        # (uuid, node ignored) -> the node it counts on
        self._told: Reminders[tuple[str, str], str] = Reminders(interval)

    def report(self, duplicates: Mapping[tuple[str, str], str]) -> None:
        """Call once per step with (uuid, node ignored) -> the node it counts on."""
        if not duplicates and not self._told:
            return
        now = self._clock()
        for key, kept in self._told.ended(duplicates):
            _log.info(
                "node %s no longer publishes GPU %s, which counts on %s", key[1], key[0], kept
            )
        for key, kept in sorted(duplicates.items()):
            uuid, ignored = key
            earlier = self._told.last(key)
            if not self._told.due(key, kept, now):
                continue
            message = (
                f"GPU {uuid} is published by nodes {kept} and {ignored}; one GPU is on one node, "
                f"so carve counts it on {kept} (it published it first) and ignores {ignored}'s. "
                f"Check the carve kubelet plugin on {ignored}: its --node-name, its simulator "
                "config, or whether the node is compromised"
            )
            if earlier != kept:
                _log.warning("duplicate GPU UUID: %s", message)
            for node in (kept, ignored):
                self._recorder.event(
                    {"metadata": {"name": node}}, Kind.NODE, "Warning", "DuplicateGpuUuid", message
                )
        self._metrics.set_duplicate_gpus(len({uuid for uuid, _ in duplicates}))
