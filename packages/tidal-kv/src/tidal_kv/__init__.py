"""tidal-kv: a paged KV cache whose offloaded layers live in host pages, prefetched into device slots."""

from tidal_kv.__about__ import __version__
from tidal_kv.config import KVConfig
from tidal_kv.errors import KVCacheError, KVConfigError
from tidal_kv.paged import KVStats, PagedKVCache

__all__ = ["KVCacheError", "KVConfig", "KVConfigError", "KVStats", "PagedKVCache", "__version__"]
