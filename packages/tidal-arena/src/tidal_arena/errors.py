"""Errors raised by tidal-arena. Messages name the option, what was given, what is accepted, and the fix."""


class ArenaError(Exception):
    """Base class of tidal-arena errors."""
