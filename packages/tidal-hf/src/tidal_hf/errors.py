"""Errors raised by tidal-hf. Messages name the option, what was given, what is accepted, and the fix."""


class TidalHFError(Exception):
    """Base class of tidal-hf errors."""
