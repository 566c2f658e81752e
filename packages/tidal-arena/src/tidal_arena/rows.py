"""Strided host<->device copies in one call: a tensor view whose leading dims index evenly spaced rows.

A view such as ``chunk[:, :, :, t0:t1]`` of a ``[2, B, H, T, D]`` buffer is ``2·B·H`` rows of
``(t1 - t0)·D`` contiguous elements, one row pitch apart. torch copies such a view between host and device
through a contiguous temporary (a kernel or a host memcpy on top of the transfer); the CUDA runtime's
``cudaMemcpy2DAsync`` moves the rows directly, in one call, at the link's rate.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch

from tidal_arena import _backend

#: cudaMemcpyDefault: the direction is inferred from the pointers (unified addressing)
_MEMCPY_DEFAULT = 4
#: pitches above this are refused by cudaMemcpy2D on current GPUs (cudaDevAttrMaxPitch)
_MAX_PITCH = 2**31 - 1

_runtime: Any = None
_runtime_checked = False


class Rows(NamedTuple):
    """A tensor view as evenly spaced rows of contiguous bytes."""

    count: int
    """Rows."""
    width: int
    """Bytes per row."""
    pitch: int
    """Bytes from one row's start to the next (``width`` when the rows are back to back)."""


def rows_of(t: torch.Tensor, lead: int) -> Rows:
    """``t`` as rows: its first ``lead`` dims index the rows, its other dims are one contiguous row.

    Args:
        t: Any strided tensor.
        lead: How many leading dims index rows (0: the whole tensor is one row).

    Raises:
        ValueError: the trailing dims are not contiguous, or the leading dims are not one even stride.
    """
    if not 0 <= lead <= t.dim():
        raise ValueError(f"lead={lead} is not accepted: expected 0..{t.dim()} for a {t.dim()}-d tensor")
    inner = t.shape[lead:]
    expected = 1
    for size, stride in zip(reversed(inner), reversed(t.stride()[lead:])):
        if size != 1 and stride != expected:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} has non-contiguous rows"
            )
        expected *= size
    count = math.prod(t.shape[:lead])
    pitch = expected  # elements; back to back unless a leading dim says otherwise
    dims = [(s, st) for s, st in zip(t.shape[:lead], t.stride()[:lead]) if s != 1]
    if dims:
        pitch = dims[-1][1]
        span = pitch
        for size, stride in reversed(dims):
            if stride != span:
                raise ValueError(
                    f"the leading {lead} dims of shape {tuple(t.shape)} and strides {t.stride()} are not evenly spaced rows"
                )
            span *= size
    if pitch < expected:
        raise ValueError(f"rows of shape {tuple(t.shape)} and strides {t.stride()} overlap")
    elt = t.element_size()
    return Rows(count, expected * elt, pitch * elt)


def cuda_runtime() -> Any:
    """CuPy's CUDA runtime module, or None (looked up once per process)."""
    global _runtime, _runtime_checked
    if not _runtime_checked:
        _runtime, _ = _backend.cupy_runtime()
        _runtime_checked = True
    return _runtime


class RowCopy:
    """A copy of ``src`` into ``dst`` (same shape and dtype, both rows by :func:`rows_of`), checked once.

    Calling it issues the copy: between host and CUDA memory with CuPy present, one ``cudaMemcpy2DAsync`` on
    ``stream`` (a ``torch.cuda.Stream``; None: the current stream), asynchronous when the host side is
    page-locked. Anywhere else (CPU to CPU, no CuPy, a pitch too large) it is ``dst.copy_(src)`` on
    ``stream``. A decode loop that moves the same views every step builds the copy once and calls it.

    Raises:
        ValueError: shapes or dtypes differ, or a side is not rows (see :func:`rows_of`).
    """

    __slots__ = ("_args", "_device", "_runtime", "dst", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, lead: int) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"copy_rows needs the same shape and dtype: dst {tuple(dst.shape)} {dst.dtype}, "
                f"src {tuple(src.shape)} {src.dtype}"
            )
        d, s = rows_of(dst, lead), rows_of(src, lead)
        self.dst, self.src = dst, src
        runtime = cuda_runtime() if dst.is_cuda != src.is_cuda else None
        if runtime is not None and (max(d.pitch, s.pitch) > _MAX_PITCH or d.count * d.width == 0):
            runtime = None
        self._runtime = runtime
        # the memcpy2D arguments before the stream: dst, dpitch, src, spitch, width, height, kind
        self._args = (dst.data_ptr(), d.pitch, src.data_ptr(), s.pitch, d.width, d.count, _MEMCPY_DEFAULT)
        self._device = dst.device if dst.is_cuda else src.device

    def __call__(self, stream: Any = None) -> None:
        """Issue the copy on ``stream`` (None: the current stream)."""
        if self._runtime is None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.dst.copy_(self.src, non_blocking=True)
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        self._runtime.memcpy2DAsync(*self._args, stream.cuda_stream)


def copy_rows(dst: torch.Tensor, src: torch.Tensor, lead: int, stream: Any = None) -> None:
    """Copy ``src`` into ``dst`` once: ``RowCopy(dst, src, lead)(stream)`` (see :class:`RowCopy`)."""
    RowCopy(dst, src, lead)(stream)
