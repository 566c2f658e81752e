"""Errors raised by the tidal meta-package and its CLI."""

from __future__ import annotations


class TidalError(Exception):
    """Base class of the meta-package's own errors (the CLI prints them without a traceback)."""


class MissingComponentError(ImportError):
    """A name of tidal's curated API whose package (or whose name in that package) is not available.

    It is an ``ImportError`` so that ``from tidal import load_model`` shows this message, not Python's
    generic "cannot import name".
    """


class CLIError(TidalError, ValueError):
    """Bad command-line or demo input: names the option, what was given, what is accepted, and the fix."""
