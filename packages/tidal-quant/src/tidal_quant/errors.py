"""Errors raised by tidal-quant. Messages name the option, what was given, what is accepted, and the fix."""


class QuantError(Exception):
    """Base class of tidal-quant errors."""
