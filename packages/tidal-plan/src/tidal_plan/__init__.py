"""tidal-plan."""

from tidal_plan.__about__ import __version__
from tidal_plan.errors import PlanError

__all__ = ["__version__", "PlanError"]
