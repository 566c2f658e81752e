"""Errors raised by tidal-arena. Messages name the option, what was given, what is accepted, and the fix."""

from __future__ import annotations


class ArenaError(Exception):
    """Base class of tidal-arena errors."""


class ArenaExhausted(ArenaError):
    """An allocation does not fit: no free block is large enough and the arena may not grow further.

    The message states the bytes requested, the bytes free, the largest free block, the bytes still
    waiting for a copy's event, the cap, and how to fix it.
    """


class PageLockLimitError(ArenaError):
    """Page-locking memory failed or would exceed the page-lock budget (the cap or ``ulimit -l``)."""
