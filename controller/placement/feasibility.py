"""What a GPU state can still take; the geometry facts the search, scoring and explanations share.

Kept apart from :mod:`.scoring` because feasibility is not a matter of policy: every policy
sees the same feasible placements and differs only in the order it prefers them.
"""

from __future__ import annotations

from controller.model import WHOLE_GPU, Occupancy
from driver.geometry import EMPTY_STATE, Geometry


def occupancy_after(
    geometry: Geometry, occupancy: Occupancy, profile_id: int, start: int
) -> Occupancy | None:
    """The GPU's occupancy once the placement is added, or None if it does not fit.

    A whole GPU fits only an idle GPU and then blocks it; a blocked GPU (whole GPU held, or
    holds that contradict each other) takes nothing, so the engine never builds on it.
    """
    if occupancy.blocked:
        return None
    if profile_id == WHOLE_GPU:
        return Occupancy(EMPTY_STATE, blocked=True) if not occupancy.state.instances else None
    if not geometry.fits(occupancy.state, profile_id, start):
        return None
    return Occupancy(geometry.place(occupancy.state, profile_id, start))


def profile_name(geometry: Geometry, profile_id: int) -> str:
    """The name users know a profile by, for explanations ("whole-GPU" for a whole GPU)."""
    if profile_id == WHOLE_GPU:
        return "whole-GPU"
    return geometry.model.profile_by_id(profile_id).name
