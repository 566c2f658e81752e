"""Errors raised by tidal-stream. Messages name the option, what was given, what is accepted, and the fix."""


class StreamError(Exception):
    """Base class of tidal-stream errors."""
