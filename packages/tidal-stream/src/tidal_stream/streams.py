"""Copy streams and events, with CPU stand-ins so the same code runs in CPU-only CI.

Every mechanism of tidal-stream moves tensors between the GPU and pinned host memory on two side
streams, one per direction, and guards each tensor in flight with an event. This module is the one
place that knows whether those are real CUDA objects or stand-ins:

- :class:`DeviceStreams` ``(device)`` — ``.h2d`` (host → device copies) and ``.d2h`` (device → host
  copies). On ``cuda`` these are two ``torch.cuda.Stream`` objects created once per device and shared by
  all users (:func:`device_streams` caches them); on ``cpu`` they are :class:`NullStream` stand-ins.
  ``.compute()`` returns the stream the caller's kernels run on now (``torch.cuda.current_stream``;
  a :class:`NullStream` on the CPU).
- :func:`stream_context` ``(stream)`` — ``with stream_context(s): ...`` issues work on ``s``
  (``torch.cuda.stream``); a no-op for stand-ins.
- :func:`record_event` ``(stream=None)`` — records an event on ``stream`` (default: the current
  stream) and returns a :class:`StreamEvent` with ``.wait(stream=None)`` (make ``stream`` — default the
  current one — wait for it on the device, host not blocked), ``.query()`` (has it completed?) and
  ``.synchronize()`` (block the host until it has). On the CPU every copy is synchronous, so the
  stand-in :class:`CompletedEvent` is always complete: ``query()`` is True and the waits return at once.
- :func:`wait_stream` ``(waiter, waitee)`` — ``waiter`` waits for all work queued so far on ``waitee``.

Rules kept by callers (DESIGN §3): one H2D and one D2H stream per device; every tensor in flight is
paired with the event that guards it and a held reference, rather than ``record_stream``; a one-line
"why" comment sits next to each stream, event and wait.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "CompletedEvent",
    "CudaEvent",
    "DeviceStreams",
    "NullStream",
    "StreamEvent",
    "device_streams",
    "record_event",
    "stream_context",
    "wait_stream",
]


class NullStream:
    """Stand-in for a CUDA stream on the CPU: work "issued" on it runs synchronously."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "NullStream()"

    def synchronize(self) -> None:
        """Nothing is ever pending on a null stream."""


@runtime_checkable
class StreamEvent(Protocol):
    """What :func:`record_event` returns: an event guarding the work queued before it."""

    def wait(self, stream: torch.cuda.Stream | NullStream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait on the device; the host is not blocked."""

    def query(self) -> bool:
        """True once all work recorded before the event has completed."""

    def synchronize(self) -> None:
        """Block the calling host thread until the event has completed."""


class CompletedEvent:
    """The CPU stand-in of an event: copies on the CPU are synchronous, so it is complete at birth."""

    __slots__ = ()

    def wait(self, stream: torch.cuda.Stream | NullStream | None = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always True."""
        return True

    def synchronize(self) -> None:
        """Returns at once."""

    def __repr__(self) -> str:
        return "CompletedEvent()"


class CudaEvent:
    """A recorded ``torch.cuda.Event`` (timing off: cheaper to record and wait on)."""

    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event(enable_timing=False)
        self.event.record(stream)

    def wait(self, stream: torch.cuda.Stream | NullStream | None = None) -> None:
        """Device-side wait of ``stream`` (default: current) on this event; the host continues."""
        if isinstance(stream, NullStream):
            # a CPU consumer cannot wait on the device: it must block until the copy has landed
            self.event.synchronize()
            return
        target = stream if stream is not None else torch.cuda.current_stream(self.event.device)
        target.wait_event(self.event)

    def query(self) -> bool:
        """True once the work before the event is done."""
        return bool(self.event.query())

    def synchronize(self) -> None:
        """Block the host until the event completes."""
        self.event.synchronize()

    def __repr__(self) -> str:
        return f"CudaEvent(done={self.query()})"


_NULL = NullStream()
_COMPLETED = CompletedEvent()


class DeviceStreams:
    """The two copy streams of one device: ``h2d`` (host → device) and ``d2h`` (device → host).

    Args:
        device: ``"cuda"``, ``"cuda:N"``, a ``torch.device`` or ``"cpu"`` (stand-ins).

    Prefer :func:`device_streams`, which returns one shared instance per device.
    """

    def __init__(self, device: torch.device | str) -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device: torch.device = dev
        self.is_cuda: bool = dev.type == "cuda"
        if self.is_cuda:
            # H2D: weight refills and updated weights travel here, off the compute stream so they overlap it
            self.h2d: torch.cuda.Stream | NullStream = torch.cuda.Stream(dev)
            # D2H: gradients (and offloaded activations) leave here, overlapping the rest of backward
            self.d2h: torch.cuda.Stream | NullStream = torch.cuda.Stream(dev)
        else:
            self.h2d = _NULL
            self.d2h = _NULL

    def compute(self) -> torch.cuda.Stream | NullStream:
        """The stream kernels are issued on right now (the caller's current stream)."""
        if self.is_cuda:
            return torch.cuda.current_stream(self.device)
        return _NULL

    def synchronize(self) -> None:
        """Block the host until both copy streams are idle."""
        self.h2d.synchronize()
        self.d2h.synchronize()

    def __repr__(self) -> str:
        return f"DeviceStreams({self.device})"


_CACHE: dict[torch.device, DeviceStreams] = {}
_CACHE_LOCK = threading.Lock()


def device_streams(device: torch.device | str) -> DeviceStreams:
    """The shared :class:`DeviceStreams` of ``device`` (created on first use)."""
    streams = DeviceStreams(device)  # normalises the device; cheap on the CPU
    key = streams.device
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is None:
            _CACHE[key] = cached = streams
    return cached


@contextlib.contextmanager
def stream_context(stream: torch.cuda.Stream | NullStream | None) -> Iterator[None]:
    """Issue the enclosed work on ``stream`` (``torch.cuda.stream``); no-op for stand-ins and None."""
    if stream is None or isinstance(stream, NullStream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def record_event(stream: torch.cuda.Stream | NullStream | None = None) -> StreamEvent:
    """Record an event on ``stream`` (default: the current CUDA stream, or the CPU stand-in).

    Returns:
        A :class:`CudaEvent`, or the always-complete :class:`CompletedEvent` on the CPU.
    """
    if isinstance(stream, NullStream):
        return _COMPLETED
    if stream is None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return _COMPLETED
        stream = torch.cuda.current_stream()
    return CudaEvent(stream)


def wait_stream(
    waiter: torch.cuda.Stream | NullStream | None, waitee: torch.cuda.Stream | NullStream | None
) -> None:
    """Make ``waiter`` wait (on the device) for everything queued so far on ``waitee``."""
    if waiter is None or waitee is None or isinstance(waiter, NullStream) or isinstance(waitee, NullStream):
        return
    waiter.wait_stream(waitee)
