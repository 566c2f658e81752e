"""Errors raised by tidal-kv. Messages name the option, what was given, what is accepted, and the fix."""


class KVCacheError(Exception):
    """Base class of tidal-kv errors."""
