"""Errors raised by tidal-quant. Messages name the option, what was given, what is accepted, and the fix."""

from __future__ import annotations


class QuantError(ValueError):
    """Bad input to a tidal-quant function: the message names the argument, the value, what is accepted.

    Subclasses ``ValueError`` so callers that guard generic bad-value errors also catch it.
    """


def bad_arg(name: str, given: object, accepted: str, fix: str = "") -> QuantError:
    """Build a :class:`QuantError` with the standard message layout."""
    msg = f"{name}: got {given!r}; accepted: {accepted}"
    if fix:
        msg += f". Fix: {fix}"
    return QuantError(msg)
