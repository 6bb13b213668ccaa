"""The placement engine: node, GPU and MIG placement for every carve claim of a pod at once.

Pure: it reads a :class:`~controller.model.ClusterModel` and answers with a :class:`Placement`
(one device per request slot, all on one node) or a :class:`NoPlacement` that says why, in words
fit for an event. It never changes the model, so a failed write leaves nothing behind; the
controller's model follows the claims as the API returns them.

One concern per module:

| module | what it decides |
|---|---|
| :mod:`.values` | the public values: request, placement, refusal, limits |
| :mod:`.engine` | :class:`PlacementEngine`: one decision, firstAvailable combinations, limits |
| :mod:`.eligibility` | which devices a request may use (class, capacity, CEL selectors) |
| :mod:`.scoring` | **the packing policy** (best fit, least waste, first fit); change it there |
| :mod:`.search` | the single-device bucket scan and the multi-device search per node |
| :mod:`.explain` | refusals in words |
| :mod:`.feasibility`, :mod:`.records`, :mod:`.cache` | shared geometry facts, records, memo table |

The names below are the package's interface; import them from ``controller.placement``.
"""

from controller.placement.engine import PlacementEngine
from controller.placement.scoring import DEFAULT_POLICY, Policy
from controller.placement.values import (
    MAX_COMBINATIONS,
    MAX_DEVICES_PER_POD,
    MAX_RESULTS_PER_CLAIM,
    ClaimToPlace,
    DeviceChoice,
    NoPlacement,
    NoPlacementReason,
    Placement,
    PlacementRequest,
)

__all__ = [
    "DEFAULT_POLICY",
    "MAX_COMBINATIONS",
    "MAX_DEVICES_PER_POD",
    "MAX_RESULTS_PER_CLAIM",
    "ClaimToPlace",
    "DeviceChoice",
    "NoPlacement",
    "NoPlacementReason",
    "Placement",
    "PlacementEngine",
    "PlacementRequest",
    "Policy",
]
