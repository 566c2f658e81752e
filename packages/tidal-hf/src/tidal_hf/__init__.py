"""tidal-hf."""

from tidal_hf.__about__ import __version__
from tidal_hf.errors import TidalHFError

__all__ = ["__version__", "TidalHFError"]
