"""Byte sizes: parse ``"24GiB"`` / ``"512MB"`` / ``"1.5 GiB"`` / ints, and format them for people."""

from __future__ import annotations

import re

from tidal_plan.errors import PlanConfigError

__all__ = ["GiB", "MiB", "format_bytes", "parse_bytes"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Binary suffixes (KiB..TiB, and the bare K/M/G/T that ulimit and docker use) and decimal ones (KB..TB).
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_ACCEPTED = "a non-negative int of bytes or a string like '24GiB', '512MB', '1.5 GiB', '64G'"


def parse_bytes(value: int | str, *, option: str = "size") -> int:
    """Parse a byte size.

    Args:
        value: Bytes as an ``int``, or a string with a unit: ``KiB/MiB/GiB/TiB`` (and bare ``K/M/G/T``)
            are powers of 1024, ``KB/MB/GB/TB`` powers of 1000. Case-insensitive; spaces allowed.
        option: Name of the option being parsed, used in the error message.

    Returns:
        The size in bytes (rounded down to an integer).

    Raises:
        PlanConfigError: For negative numbers, unknown units, or other types (``bool`` included).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PlanConfigError(option, value, _ACCEPTED, "pass e.g. '24GiB'")
    if isinstance(value, int):
        if value < 0:
            raise PlanConfigError(option, value, _ACCEPTED, "sizes cannot be negative")
        return value
    m = _PATTERN.match(value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise PlanConfigError(option, value, _ACCEPTED, "write a number followed by a unit, e.g. '24GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Format bytes for people, in binary units: ``25769803776 -> '24.0 GiB'``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"
