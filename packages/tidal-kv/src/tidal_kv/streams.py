"""Stream, event and profiler helpers that turn into no-ops on the CPU (``stream is None``), where copies are synchronous."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.profiler import record_function

_NULL = contextlib.nullcontext()
# the C methods under torch.cuda.Event.record / .wait (and Stream.wait_event), called without their Python
# wrappers, which only resolve a default stream these helpers always pass; None on a CPU-only build
_EVENT_BASE = getattr(torch._C, "_CudaEventBase", None)
_RECORD = getattr(_EVENT_BASE, "record", None)
_WAIT = getattr(_EVENT_BASE, "wait", None)
_QUERY = getattr(_EVENT_BASE, "query", None)


class CurrentStream:
    """The current CUDA stream of one device, for a caller that asks for it on every decode step.

    ``torch.cuda.current_stream(device)`` resolves the device and builds a new ``Stream`` object per call,
    tens of microseconds on a busy host; this reads the current stream's id directly and hands back the same
    ``Stream`` object while the current stream stays the same (a ``torch.cuda.stream(...)`` context switches
    it, and the next call follows).
    """

    __slots__ = ("_index", "_key", "_lookup", "_stream")

    def __init__(self, device: torch.device) -> None:
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._lookup = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream id, device, device type)
        self._key: Any = None
        self._stream: Any = None

    def __call__(self) -> Any:
        """The device's current stream (the same object as the last call's when it did not change)."""
        if self._lookup is None:  # a torch without the private lookup: the public call
            return torch.cuda.current_stream(self._index)
        key = self._lookup(self._index)
        if key != self._key:
            self._stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._key = key
        return self._stream


def record(stream: Any, event: Any = None) -> Any:
    """Record ``event`` (a new CUDA event when None) on ``stream`` now and return it; None on the CPU.

    Re-recording a long-lived event is safe: ``wait`` calls queued before see the record they were queued
    after (CUDA captures an event's state when the wait is queued), so callers that own one event per
    purpose avoid creating events in the decode loop.
    """
    if stream is None:
        return None
    ev = torch.cuda.Event() if event is None else event
    if _RECORD is not None and type(stream) is torch.cuda.Stream:
        _RECORD(ev, stream)
    else:
        ev.record(stream)
    return ev


def wait(stream: Any, event: Any) -> None:
    """Make ``stream`` wait for ``event``: nothing on the CPU, without an event, or once the event completed.

    [Note: completed events] On the GPU machine, 16 waits of the compute stream on H2D copies made a
    host-bound 8B decode step 3-4 % slower (60-90 µs each), even when the copies had finished two layers
    before (``benchmarks/kv/page_traffic.py``). A completed event orders nothing any more, so ``query()``
    first: in a host-bound decode step the gathers and the attention these waits guard have usually
    finished by the time a wait on them is issued (TidalCache at 4k x 1: 28 waits inserted in 125 rounds
    instead of 4,017), and none is inserted.
    """
    if stream is None or event is None:
        return
    if _QUERY is not None and type(event) is torch.cuda.Event:
        if not _QUERY(event):
            _WAIT(event, stream)
    elif not event.query():
        stream.wait_event(event)


def on(stream: Any) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)``, or a no-op context on the CPU."""
    return torch.cuda.stream(stream) if stream is not None else _NULL


def synchronize(*streams: Any) -> None:
    """Block the host until every given stream (None entries skipped) finished its queued work."""
    for s in streams:
        if s is not None:
            s.synchronize()


profiling = torch.autograd._profiler_enabled
"""Whether a profiler is recording (a C call: the cheap test before entering a ``record_function``)."""


def profiled(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler runs, else a shared no-op context.

    An idle ``record_function`` still costs a few microseconds per entry; the cache enters several per layer
    and step, which adds up to a visible share of a decode step's host time when no one is profiling.
    """
    return record_function(name) if profiling() else _NULL


_F = TypeVar("_F", bound=Callable[..., Any])


def ranged(name: str) -> Callable[[_F], _F]:
    """Decorate a method to run inside ``record_function(name)`` while a profiler runs.

    When no one profiles this costs one call frame, where ``with profiled(name):`` costs three (the helper
    and the no-op context's enter and exit): for the methods a decode step calls once per layer.
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if profiling():
                with record_function(name):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
