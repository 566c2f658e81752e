"""Errors raised by tidal-hf. Messages name the option, what was given, what is accepted, and the fix."""

from __future__ import annotations


class TidalHFError(Exception):
    """Base class of tidal-hf errors."""


class OptionError(TidalHFError, ValueError):
    """An argument of a tidal-hf function has an invalid value (subclasses ``ValueError``)."""


class CheckpointError(TidalHFError, ValueError):
    """A checkpoint cannot be loaded: missing, unsafe (pickle), incomplete or not matching the model."""


class UnsupportedModelError(TidalHFError, ValueError):
    """The model's structure does not allow the asked-for operation (e.g. a chunked loss without a linear head)."""


def bad_option(fn: str, name: str, given: object, accepted: str, fix: str = "") -> OptionError:
    """Build the standard message: function, option, what was given, what is accepted, and the fix."""
    msg = f"{fn}: {name}={given!r} is invalid; accepted: {accepted}."
    if fix:
        msg += f" Fix: {fix}"
    return OptionError(msg)
