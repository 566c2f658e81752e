"""Errors raised by tidal-plan. Messages name the option, what was given, what is accepted, and the fix."""

from __future__ import annotations


class PlanError(Exception):
    """Base class of tidal-plan errors."""


class PlanConfigError(PlanError, ValueError):
    """A bad option value (wrong type, unknown mode, impossible budget). Also a ``ValueError``."""

    def __init__(self, option: str, given: object, accepted: str, fix: str = "") -> None:
        self.option = option
        self.given = given
        self.accepted = accepted
        self.fix = fix
        msg = f"{option}={given!r} is not valid; accepted: {accepted}"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)


class InfeasiblePlan(PlanError):
    """No placement fits: the run is refused before it starts, with the numbers and the way out.

    Attributes:
        resource: What ran out: ``"vram"``, ``"host_ram"`` or ``"pagelock"``.
        needed_bytes: Bytes the cheapest placement needs in that resource.
        available_bytes: Bytes available in that resource.
        suggestions: Ways out, each a short imperative sentence with the numbers it would give.
    """

    def __init__(
        self,
        resource: str,
        needed_bytes: int,
        available_bytes: int,
        message: str,
        suggestions: tuple[str, ...] = (),
    ) -> None:
        self.resource = resource
        self.needed_bytes = int(needed_bytes)
        self.available_bytes = int(available_bytes)
        self.suggestions = tuple(suggestions)
        text = message
        if suggestions:
            text += "; " + " or ".join(suggestions)
        super().__init__(text)
