"""tidal-arena."""

from tidal_arena.__about__ import __version__
from tidal_arena.errors import ArenaError

__all__ = ["__version__", "ArenaError"]
