"""tidal-quant."""

from tidal_quant.__about__ import __version__
from tidal_quant.errors import QuantError

__all__ = ["__version__", "QuantError"]
