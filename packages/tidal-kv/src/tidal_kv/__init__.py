"""tidal-kv."""

from tidal_kv.__about__ import __version__
from tidal_kv.errors import KVCacheError

__all__ = ["__version__", "KVCacheError"]
