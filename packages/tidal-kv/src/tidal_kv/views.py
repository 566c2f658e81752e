"""Token-range views of ``[..., T, D]`` K/V buffers, made with one ``as_strided`` call.

A decode step takes several views of the cache's buffers per layer (where the new token goes, the K/V handed
to attention). ``buf[:, :, s:e]`` dispatches one slice per indexed dim and ``narrow`` three ops; on the
host of a batch-1 decode, which is what bounds its speed, one ``as_strided`` with precomputed sizes and
strides is the cheapest way to the same view.
"""

from __future__ import annotations

import torch


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
