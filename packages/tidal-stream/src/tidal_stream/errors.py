"""Errors raised by tidal-stream. Messages name the option, what was given, what is accepted, and the fix."""

from __future__ import annotations


class StreamError(Exception):
    """Base class of tidal-stream errors."""


class OptionError(StreamError, ValueError):
    """A ``wrap()`` option (or an optimizer argument) is unknown or has an invalid value.

    Subclasses ``ValueError`` so callers may catch either.
    """


class NotWrappedError(StreamError, ValueError):
    """``unwrap()`` / ``memory_report()`` was given a model that ``wrap()`` has not wrapped."""


class StateDictError(StreamError, ValueError):
    """A checkpoint given to ``OffloadAdamW.load_state_dict`` does not match the optimizer's parameters."""


def option_error(name: str, given: object, accepted: str, fix: str = "") -> OptionError:
    """Build the standard message: option, what was given, what is accepted, and the fix."""
    msg = f"wrap(): option {name}={given!r} is invalid; accepted: {accepted}."
    if fix:
        msg += f" Fix: {fix}"
    return OptionError(msg)


class StreamingError(StreamError):
    """Weight or activation streaming was configured or used wrongly."""


class SlotBudgetError(StreamingError, ValueError):
    """A block's weights exceed the per-slot byte budget (``slot_bytes``)."""
