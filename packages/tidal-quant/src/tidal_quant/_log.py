"""Observability: which compute path each call took, and a record of every degradation or choice.

``path_counts()`` lets a test assert, e.g., that FP8 ``QuantLinear`` ran through ``torch._scaled_mm``.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

log = logging.getLogger("tidal_quant")

_lock = threading.Lock()
_paths: collections.Counter[str] = collections.Counter()
_decisions: list[dict[str, Any]] = []
_seen: set[str] = set()

PATHS = ("fp8_scaled_mm", "fp8_recast", "fused_dequant_matmul", "dequant_matmul")


def record_path(name: str) -> None:
    """Count one forward call that took compute path ``name`` (one of :data:`PATHS`)."""
    assert name in PATHS, name
    with _lock:
        _paths[name] += 1


def path_counts() -> dict[str, int]:
    """Forward calls per compute path since the last :func:`reset_path_counts`.

    Paths: ``fp8_scaled_mm`` (FP8 tensor cores), ``fused_dequant_matmul`` (one Triton kernel),
    ``dequant_matmul`` (dequantize to the activation dtype, then a dense matmul). ``fp8_recast`` counts the
    forward calls of ``fp8_compute`` layers whose weight was recast to e4m3 for FP8 tensor cores (each is
    also counted under ``fp8_scaled_mm``).
    """
    with _lock:
        return dict(_paths)


def reset_path_counts() -> None:
    """Zero the counters of :func:`path_counts`."""
    with _lock:
        _paths.clear()


def record(
    kind: str, message: str, *, once_key: str | None = None, level: int = logging.INFO, **fields: Any
) -> None:
    """Log ``message`` and append it to :func:`decisions`; with ``once_key``, only the first time."""
    with _lock:
        if once_key is not None:
            if once_key in _seen:
                return
            _seen.add(once_key)
        _decisions.append({"kind": kind, "message": message, **fields})
    log.log(level, "%s", message)


def decisions() -> list[dict[str, Any]]:
    """Every recorded degradation (e.g. FP8 without tensor cores) and per-shape kernel choice."""
    with _lock:
        return list(_decisions)
