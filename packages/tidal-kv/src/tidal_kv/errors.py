"""Errors raised by tidal-kv. Messages name the option, what was given, what is accepted, and the fix."""


class KVCacheError(Exception):
    """Base class of tidal-kv errors."""


class KVConfigError(KVCacheError, ValueError):
    """A bad option to :class:`~tidal_kv.KVConfig` / :class:`~tidal_kv.PagedKVCache`, or a K/V tensor that does
    not match the cache (shape, dtype, device)."""
