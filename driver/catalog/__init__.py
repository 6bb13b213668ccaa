"""Static facts about MIG-capable GPU models.

The types (``model``) live apart from the table of catalogued models (``data``): the types
describe any GPU, including ones discovered on hardware that the table never lists, while the
table is evidence-labelled facts that change for other reasons. Both are re-exported here, so
``driver.catalog`` stays the one import path.
"""

from driver.catalog.data import CATALOG, gpu_model
from driver.catalog.model import (
    ALL_MEDIA_INDICES,
    NO_ENGINES,
    NO_MEDIA_INDICES,
    Architecture,
    Engines,
    Evidence,
    GpuModel,
    Placement,
    ProfileIndex,
    ProfileSpec,
)

__all__ = [
    "ALL_MEDIA_INDICES",
    "CATALOG",
    "NO_ENGINES",
    "NO_MEDIA_INDICES",
    "Architecture",
    "Engines",
    "Evidence",
    "GpuModel",
    "Placement",
    "ProfileIndex",
    "ProfileSpec",
    "gpu_model",
]
