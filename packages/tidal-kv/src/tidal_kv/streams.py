"""Stream and event functions that turn into no-ops on the CPU (``stream is None``), where copies are synchronous."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def record(stream: Any) -> Any:
    """A CUDA event recorded on ``stream`` now, or None on the CPU."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def wait(stream: Any, event: Any) -> None:
    """Make ``stream`` wait for ``event`` (nothing on the CPU or when there is no event)."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def on(stream: Any) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)``, or a no-op context on the CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def synchronize(*streams: Any) -> None:
    """Block the host until every given stream (None entries skipped) finished its queued work."""
    for s in streams:
        if s is not None:
            s.synchronize()
