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


class KVBuffer(TokenRange):
    """One layer's K and V in one ``[2, B, H, T, D]`` buffer, with the calls a decode step needs: a write of new
    tokens into both, and both views of ``[0, n)``.

    K and V share the buffer so that one ``torch.stack(..., out=)`` writes a token of both (one launch: on the
    GPU machine 6.0 µs of host time against 5.5 for a single ``copy_``) and one ``unbind`` splits the view
    attention reads: a whole token write with its views takes 12.4 µs, where two buffers took 19.0 (two
    ``copy_`` and four views) and DynamicCache's two ``torch.cat`` take 13.4 (``diag-kv-write-costs``).
    """

    __slots__ = ()

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``k``/``v`` (``[B, H, t, D]``) into tokens ``[start, start + t)``."""
        torch.stack((k, v), out=self(start, k.shape[-2]))

    def upto(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V views of tokens ``[0, length)``, ``[B, H, length, D]`` each."""
        return self(0, length).unbind(0)

    def append(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`write` ``k``/``v`` at ``start``, then the K and V views of everything up to them."""
        torch.stack((k, v), out=self(start, k.shape[-2]))
        return self(0, start + k.shape[-2]).unbind(0)


class TailPage:
    """An offloaded layer's partial page on the device, ``buf`` ``[2, B, H, P, D]`` (K and V).

    A decode step writes one token into it and then copies it behind the gathered pages. The view of a
    one-token write is the same for every page the layer fills (the buffer is reused), so it is made once per
    position and kept: ``P`` small views instead of a new one per step.
    """

    __slots__ = ("_token", "at", "buf")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.at = TokenRange(buf)
        self._token: list[torch.Tensor | None] = [None] * buf.shape[-2]

    def write_token(self, t: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[B, H, 1, D]``) as token ``t``, with one launch (see :class:`KVBuffer`)."""
        view = self._token[t]
        if view is None:
            view = self._token[t] = self.at(t, 1)  # [2, B, H, 1, D]
        torch.stack((k, v), out=view)
