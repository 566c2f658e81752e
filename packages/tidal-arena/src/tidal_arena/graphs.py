"""Work queued on one CUDA stream, captured once as a CUDA graph and replayed with one launch.

A decode loop queues the same few copies and kernels on a side stream step after step, and at batch 1 what
they cost is the host time to issue them: a Triton launch takes 20-50 µs of Python, a graph launch a few.
CuPy's runtime captures and launches on the raw stream handle, so a replay needs no torch stream context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from tidal_arena.rows import cuda_runtime

#: cudaStreamCaptureModeThreadLocal: only this thread's unsafe calls (a cudaMalloc) break the capture
_THREAD_LOCAL = 1
_ALLOCATIONS = "allocation.all.allocated"  # torch's count of device allocations made so far
# the current CUDA device's index, without torch.cuda.current_device()'s lazy-init check (launch calls it)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


class StreamGraph:
    """The calls a function queues on one stream, captured once (:meth:`capture`), replayed by :meth:`launch`.

    A replay repeats the captured copies and kernels with the same pointers and arguments: the memory they
    touch must outlive the graph and stay where it is (preallocated buffers, page-locked host memory).
    """

    __slots__ = ("_device", "_exec", "_graph", "_runtime")

    def __init__(self, runtime: Any, graph: int, exec_: int, device: int) -> None:
        self._runtime, self._graph, self._exec = runtime, graph, exec_
        self._device = device  # the stream's device: captured, instantiated and launched with it current

    @classmethod
    def capture(cls, stream: torch.cuda.Stream, issue: Callable[[], None]) -> StreamGraph | None:
        """Capture what ``issue()`` queues on ``stream`` (made the current stream while it runs).

        Nothing runs while capturing: the captured work runs on each :meth:`launch`. ``issue`` must queue
        only on ``stream``, must not synchronize, and must not allocate device memory (checked: torch could
        hand the memory to someone else while the graph still writes it).

        Args:
            stream: A non-default CUDA stream.
            issue: Queues the work (copies between page-locked host memory and the device, kernels).

        Returns:
            The graph, or None where CUDA graphs are not available here (no CuPy or no CUDA device).

        Raises:
            RuntimeError: ``issue`` allocated device memory, or queued something a graph cannot hold (CUDA's
                error names it); the stream is left out of capture mode either way.
        """
        runtime = cuda_runtime()
        if runtime is None:
            return None
        # why: CuPy's calls act on the current device; the stream may belong to another one
        with torch.cuda.device(stream.device):
            return cls._capture(runtime, stream, issue)

    @classmethod
    def _capture(cls, runtime: Any, stream: torch.cuda.Stream, issue: Callable[[], None]) -> StreamGraph:
        """:meth:`capture` with the stream's device current."""
        handle = stream.cuda_stream
        before = torch.cuda.memory_stats(stream.device).get(_ALLOCATIONS, 0)
        runtime.streamBeginCapture(handle, _THREAD_LOCAL)
        try:
            with torch.cuda.stream(stream):  # why: torch ops and Triton kernels launch on the current stream
                issue()
        except BaseException:
            with contextlib.suppress(Exception):  # why: leave capture mode; the capture's own error is raised
                runtime.graphDestroy(runtime.streamEndCapture(handle))
            raise
        graph = runtime.streamEndCapture(handle)
        if torch.cuda.memory_stats(stream.device).get(_ALLOCATIONS, 0) != before:
            runtime.graphDestroy(graph)
            raise RuntimeError(
                "StreamGraph.capture: the captured work allocated device memory; allocate its buffers "
                "before capturing"
            )
        try:
            exec_ = runtime.graphInstantiate(graph)
        except BaseException:
            runtime.graphDestroy(graph)
            raise
        return cls(runtime, graph, exec_, stream.device.index)

    def launch(self, stream: torch.cuda.Stream) -> None:
        """Queue the captured work on ``stream`` (of the captured stream's device), after what is queued there."""
        if _current_device() == self._device:
            self._runtime.graphLaunch(self._exec, stream.cuda_stream)
            return
        with torch.cuda.device(self._device):  # why: a model on another GPU than the current one
            self._runtime.graphLaunch(self._exec, stream.cuda_stream)

    def __del__(self) -> None:
        # CUDA frees a graph still in flight once it completes; at interpreter shutdown there is nothing to free
        with contextlib.suppress(Exception):
            self._runtime.graphExecDestroy(self._exec)
            self._runtime.graphDestroy(self._graph)
