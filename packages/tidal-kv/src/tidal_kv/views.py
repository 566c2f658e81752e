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


class KVRange:
    """Token ranges of a K buffer and a V buffer of one shape and strides (``[..., T, D]``), as the decode step
    needs them: a write of new tokens into both, and both views of ``[0, n)``.

    One call where :class:`TokenRange` would take two, on the host path of every layer and step.
    """

    __slots__ = ("_d", "_k_off", "_lead", "_step", "_stride", "_v_off", "k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape != v.shape or k.stride() != v.stride():
            raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} views must share shape and strides")
        self.k, self.v = k, v
        self._lead = tuple(k.shape[:-2])
        self._d = k.shape[-1]
        self._stride = k.stride()
        self._k_off, self._v_off = k.storage_offset(), v.storage_offset()
        self._step = k.stride(-2)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``k``/``v`` (``[..., t, D]``) into tokens ``[start, start + t)`` of the buffers."""
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

    __slots__ = ("_token", "at", "buf", "k_at", "v_at")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.at, self.k_at, self.v_at = TokenRange(buf), TokenRange(buf[0]), TokenRange(buf[1])
        self._token: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * buf.shape[-2]

    def token(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[B, H, 1, D]`` K and V views of token ``t`` (made on first use, then kept)."""
        views = self._token[t]
        if views is None:
            views = self._token[t] = (self.k_at(t, 1), self.v_at(t, 1))
        return views
