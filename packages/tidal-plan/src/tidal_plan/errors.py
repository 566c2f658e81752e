"""Errors raised by tidal-plan. Messages name the option, what was given, what is accepted, and the fix."""


class PlanError(Exception):
    """Base class of tidal-plan errors."""
