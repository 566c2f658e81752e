"""Token-range views of ``[..., T, D]`` K/V buffers, made with one ``as_strided`` call.

A decode step takes several views of the cache's buffers per layer (where the new token goes, the K/V handed
to attention). ``buf[:, :, s:e]`` dispatches one slice per indexed dim and ``narrow`` three ops; on the
host of a batch-1 decode, which is what bounds its speed, one ``as_strided`` with precomputed sizes and
strides is the cheapest way to the same view.

[Note: token writes] The new token's K and V go into a fixed place of a buffer on every layer and step. A
``copy_`` of it costs 7 µs of host time on the GPU machine, as much as ``torch.cat`` and more than the copy it
issues (``kv-host-costs-*``). Both sides are evenly spaced rows of ``D`` elements (``B·H`` of them), so on a
CUDA device with CuPy :class:`RowWrites` issues the same copy as one ``cudaMemcpy2DAsync`` on the current
stream, with the destination's pitch and rows worked out once. The source's pointer and strides are read
per call; a source whose rows are not evenly spaced (a view of a fused projection, say) takes ``copy_``.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal_arena import cuda_runtime, rows_of

# the current stream's raw handle in one C call (None on a torch without it, or without CUDA)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (unified addressing)


class RowWrites:
    """Writes into token ranges of a CUDA ``[..., T, D]`` buffer whose leading dims are evenly spaced rows, as
    one ``cudaMemcpy2DAsync`` each, on the current stream (see [Note: token writes]).

    Build with :meth:`of`, which answers None where the copy cannot be issued this way (CPU, no CuPy).
    """

    __slots__ = ("_base", "_d", "_elt", "_index", "_lead", "_pitch", "_rows", "_runtime", "_step")

    def __init__(self, buf: torch.Tensor, runtime: Any) -> None:
        one = rows_of(buf.narrow(-2, 0, 1), buf.dim() - 2)  # token 0 of every row
        self._runtime = runtime
        self._base = buf.data_ptr()
        self._elt = buf.element_size()
        self._step = buf.stride(-2) * self._elt  # bytes from one token to the next
        self._pitch, self._rows = one.pitch, one.count
        self._lead = tuple(buf.shape[:-2])
        self._d = buf.shape[-1]
        self._index = buf.device.index

    @classmethod
    def of(cls, buf: torch.Tensor) -> RowWrites | None:
        """The writer of ``buf``, or None where its writes must be ``copy_`` (not CUDA, no CuPy, rows uneven)."""
        if not buf.is_cuda or _RAW_STREAM is None or buf.dim() < 3 or buf.stride()[-2:] != (buf.shape[-1], 1):
            return None
        runtime = cuda_runtime()
        if runtime is None:
            return None
        try:
            return cls(buf, runtime)
        except ValueError:  # leading dims not evenly spaced: leave the writes to copy_
            return None

    def token(self, start: int, src: torch.Tensor) -> bool:
        """Copy a ``[B, H, 1, D]`` ``src`` (the buffer's dtype and device) into token ``start`` of a 4-d
        ``[B, H, T, D]`` buffer; False, with nothing issued, when ``src``'s rows are not evenly spaced."""
        b, h = self._lead
        st = src.stride()
        row = st[1] if h > 1 else st[0] if b > 1 else self._d  # elements from one row to the next
        if (st[3] != 1 and self._d > 1) or row < self._d or (b > 1 and h > 1 and st[0] != h * row):
            return False
        elt = self._elt
        self._runtime.memcpy2DAsync(
            self._base + start * self._step, self._pitch, src.data_ptr(), row * elt, self._d * elt, self._rows,
            _MEMCPY_DEFAULT, _RAW_STREAM(self._index),  # why: queued in order with what produced the source
        )  # fmt: skip
        return True

    def rows(self, start: int, src: torch.Tensor) -> None:
        """Copy a contiguous ``src`` of the buffer's leading shape and ``n`` tokens into tokens
        ``[start, start + n)`` (the caller guarantees the shape and contiguity)."""
        width = src.shape[-2] * self._d * self._elt  # the source's rows are back to back
        self._runtime.memcpy2DAsync(
            self._base + start * self._step, self._pitch, src.data_ptr(), width, width, self._rows,
            _MEMCPY_DEFAULT, _RAW_STREAM(self._index),  # why: queued in order with what produced the source
        )  # fmt: skip


class TokenRange:
    """Views ``buf[..., start:start + length, :]`` of a strided ``[..., T, D]`` buffer.

    Args:
        buf: The buffer; its token dim is the second to last.
    """

    __slots__ = ("_d", "_lead", "_offset", "_step", "_stride", "buf")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self._lead = tuple(buf.shape[:-2])
        self._d = buf.shape[-1]
        self._stride = buf.stride()
        self._offset = buf.storage_offset()
        self._step = buf.stride(-2)

    def __call__(self, start: int, length: int) -> torch.Tensor:
        """The view of tokens ``[start, start + length)`` (the caller keeps them inside the buffer)."""
        return self.buf.as_strided(
            (*self._lead, length, self._d), self._stride, self._offset + start * self._step
        )


class KVRange:
    """Token ranges of a K buffer and a V buffer of one shape and strides (``[..., T, D]``), as the decode step
    needs them: a write of new tokens into both, and both views of ``[0, n)``.

    One call where :class:`TokenRange` would take two, on the host path of every layer and step.
    """

    __slots__ = ("_d", "_k_off", "_k_rows", "_lead", "_step", "_stride", "_v_off", "_v_rows", "k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape or k.stride() != v.stride():
            raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} views must share shape and strides")
        self.k, self.v = k, v
        # one-token writes as one memcpy each (see [Note: token writes]); None on the CPU
        self._k_rows = RowWrites.of(k) if k.dim() == 4 else None
        self._v_rows = RowWrites.of(v) if self._k_rows is not None else None
        self._lead = tuple(k.shape[:-2])
        self._d = k.shape[-1]
        self._stride = k.stride()
        self._k_off, self._v_off = k.storage_offset(), v.storage_offset()
        self._step = k.stride(-2)

    def write_token(self, start: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Copy one token's ``[B, H, 1, D]`` ``k``/``v`` into token ``start`` as one memcpy each (see [Note: token
        writes]); False, with nothing issued, where that cannot be done (the caller then copies)."""
        if self._v_rows is None or not self._k_rows.token(start, k):
            return False
        if not self._v_rows.token(start, v):
            self.v.as_strided(v.shape, self._stride, self._v_off + start * self._step).copy_(v)
        return True

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``k``/``v`` (``[..., t, D]``) into tokens ``[start, start + t)`` of the buffers."""
        if k.shape[-2] == 1 and self.write_token(start, k, v):
            return
        size, at = (*self._lead, k.shape[-2], self._d), start * self._step
        self.k.as_strided(size, self._stride, self._k_off + at).copy_(k)
        self.v.as_strided(size, self._stride, self._v_off + at).copy_(v)

    def upto(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views of tokens ``[0, length)``."""
        size, stride = (*self._lead, length, self._d), self._stride
        return self.k.as_strided(size, stride, self._k_off), self.v.as_strided(size, stride, self._v_off)

    def append(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`write` ``k``/``v`` at ``start``, then the K and V views of everything up to them."""
        self.write(start, k, v)
        return self.upto(start + k.shape[-2])


class TailPage:
    """An offloaded layer's partial page on the device, ``buf`` ``[2, B, H, P, D]`` (K and V).

    A decode step writes one token into it and then copies it behind the gathered pages. The views of a
    one-token write are the same for every page the layer fills (the buffer is reused), so they are made
    once per position and kept: ``P`` pairs of small views instead of two new ones per step.
    """

    __slots__ = ("_token", "at", "buf", "k_at", "kv", "v_at")

    def __init__(self, buf: torch.Tensor) -> None:
        if not buf.is_contiguous():
            raise ValueError(f"a partial page must be contiguous, got strides {buf.stride()}")
        self.buf = buf
        self.at, self.k_at, self.v_at = TokenRange(buf), TokenRange(buf[0]), TokenRange(buf[1])
        self.kv = KVRange(buf[0], buf[1])  # its K and V halves, [B, H, P, D] each
        self._token: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * buf.shape[-2]

    def write(self, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one token's ``[B, H, 1, D]`` ``k``/``v`` at position ``t``: one memcpy each where
        :meth:`KVRange.write_token` can, else ``copy_`` into views made on first use, then kept."""
        if self.kv.write_token(t, k, v):
            return
        views = self._token[t]
        if views is None:
            views = self._token[t] = (self.k_at(t, 1), self.v_at(t, 1))
        views[0].copy_(k)
        views[1].copy_(v)
