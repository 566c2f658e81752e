"""Host page blocks (from the tidal-arena pinned arena) and the FP8 page format.

A *chunk* is ``chunk_pages`` pages of one offloaded layer laid out like the device K/V,
``[2 (K/V), B, H, chunk_pages · page_tokens, D]``: any run of full pages inside a chunk is ``2·B·H`` evenly
spaced rows on both sides, so it moves host<->device in one strided copy (:class:`tidal_arena.RowCopy`):
native pages straight into a device slot's token range, fp8 pages into a staging chunk they are dequantized
from; no permute on the device either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tidal_arena import ArenaConfig, ArenaError, Block, PinnedArena
from tidal_kv.errors import KVCacheError

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALE_FLOOR = 1e-12  # keeps an all-zero (token, head) row from dividing by zero


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K/V to e4m3 with one fp32 scale per (token, head) row (absmax over ``head_dim``).

    Args:
        x: ``[..., D]`` floating tensor.

    Returns:
        ``(q, scale)``: ``q`` ``[..., D]`` float8_e4m3fn and ``scale`` ``[..., 1]`` float32, with
        ``q.float() * scale ≈ x``.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_SCALE_FLOOR)  # [..., 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [..., D]
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``[..., D]`` e4m3 and ``[..., 1]`` fp32 scales to ``dtype``."""
    return (q.float() * scale).to(dtype)


@dataclass
class PageChunk:
    """One host (or device-staging) chunk: page data plus, for FP8, per-row scales."""

    data: torch.Tensor
    """``[2, B, H, C·P, D]`` in the K/V dtype ("native") or float8_e4m3fn ("fp8")."""
    scale: torch.Tensor | None
    """``[2, B, H, C·P, 1]`` float32 for "fp8", else None."""

    def tokens(self, start: int, stop: int) -> PageChunk:
        """The token range ``[start, stop)`` of every (K/V, sequence, head) row: evenly spaced rows."""
        scale = self.scale[:, :, :, start:stop] if self.scale is not None else None
        return PageChunk(self.data[:, :, :, start:stop], scale)

    def store(self, kv: torch.Tensor) -> None:
        """Fill this (device staging) chunk from ``kv`` ``[2, B, H, T, D]`` of its shape, in its format.

        For fp8 storage ``kv`` is then overwritten with what the stored pages dequantize to, so a slot holds
        what a later gather of these pages returns, whichever slot serves the layer next.
        """
        if self.scale is None:
            self.data.copy_(kv)
            return
        q, scale = quantize_fp8(kv)  # [2, B, H, T, D], [2, B, H, T, 1]
        self.data.copy_(q)
        self.scale.copy_(scale)
        kv.copy_(dequantize_fp8(q, scale, kv.dtype))

    def packed(self, tokens: int) -> PageChunk:
        """``[2, B, H, tokens, D]`` (and scales) packed at the start of this buffer: a contiguous staging view."""
        two, b, h, _, d = self.data.shape
        n = two * b * h * tokens
        scale = self.scale.view(-1)[:n].view(two, b, h, tokens, 1) if self.scale is not None else None
        return PageChunk(self.data.view(-1)[: n * d].view(two, b, h, tokens, d), scale)

    @property
    def nbytes(self) -> int:
        """Bytes held by this chunk."""
        n = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n


@dataclass(frozen=True)
class ChunkLayout:
    """The layout of one chunk, shared by its host block and its device staging copy."""

    chunk_pages: int
    """Pages in the chunk."""
    batch: int
    """Sequences per batch."""
    heads: int
    """K/V heads."""
    page_tokens: int
    """Tokens per page."""
    head_dim: int
    """Head dimension."""
    dtype: torch.dtype
    """K/V dtype (the page dtype for "native" storage)."""
    fp8: bool
    """Store e4m3 + fp32 per-row scales instead of ``dtype``."""

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[2 (K/V), B, H, C·P, D]``."""
        return (2, self.batch, self.heads, self.chunk_pages * self.page_tokens, self.head_dim)

    @property
    def store_dtype(self) -> torch.dtype:
        """The dtype the pages are stored in."""
        return FP8_DTYPE if self.fp8 else self.dtype

    @property
    def data_bytes(self) -> int:
        """Bytes of the page data."""
        return (
            self.chunk_pages
            * 2
            * self.batch
            * self.heads
            * self.page_tokens
            * self.head_dim
            * self.store_dtype.itemsize
        )

    @property
    def scale_bytes(self) -> int:
        """Bytes of the fp32 per-row scales (0 unless ``fp8``)."""
        rows = self.chunk_pages * 2 * self.batch * self.heads * self.page_tokens
        return rows * 4 if self.fp8 else 0


class HostPagePool:
    """Allocates host chunks for offloaded layers from a tidal-arena :class:`~tidal_arena.PinnedArena`.

    The arena is page-locked when the cache's device is CUDA (pageable on the CPU, where nothing is copied
    over PCIe). Without CuPy the arena degrades to pageable memory; that is logged once and recorded in
    :attr:`events`, since copies from pageable memory cannot overlap compute.

    Args:
        pin: Page-lock the memory (True when the cache's device is CUDA).
    """

    def __init__(self, pin: bool) -> None:
        self.events: list[str] = []
        self._arena = PinnedArena(ArenaConfig(backend="auto" if pin else "pageable"))
        self.pinned = self._arena.pinned
        self._blocks: list[Block] = []
        self._bytes = 0
        if pin and not self.pinned:
            msg = (
                f"host KV pages are pageable ({self._arena.degraded_reason}): page gathers cannot overlap "
                "compute; install CuPy for page-locked memory"
            )
            logger.warning(msg)
            self.events.append(msg)

    @staticmethod
    def chunk_bytes(layout: ChunkLayout) -> int:
        """Host bytes of one chunk (data + FP8 scales), each part rounded up to the arena alignment."""
        return _round_up(layout.data_bytes) + (_round_up(layout.scale_bytes) if layout.fp8 else 0)

    def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of host memory in one slab now (page-locking is slow: never per step).

        Raises:
            KVCacheError: the arena cannot hold it (the message carries the arena's numbers and the fixes).
        """
        if nbytes <= 0:
            return
        try:
            self._arena.reserve(nbytes)
        except ArenaError as e:
            raise KVCacheError(
                f"the offloaded layers' host pages need {nbytes / 2**30:.2f} GiB and the host arena refused: {e} "
                'Fix: lower max_tokens or the batch, keep more resident_layers, or pass storage="fp8".'
            ) from e

    def _raw(self, nbytes: int, tag: str) -> torch.Tensor:
        """A uint8 ``[nbytes]`` host tensor from the arena."""
        block = self._arena.alloc(nbytes, tag=tag)
        self._blocks.append(block)
        return block.tensor(torch.uint8, (nbytes,))

    def chunk(self, layout: ChunkLayout) -> PageChunk:
        """Allocate one host chunk of ``layout`` (K and V pages).

        Returns:
            The chunk; its memory lives until :meth:`release`.
        """
        shape, store = layout.shape, layout.store_dtype
        data = self._raw(layout.data_bytes, "kv-pages").view(store).view(shape)
        scale = None
        if layout.fp8:
            scale = self._raw(layout.scale_bytes, "kv-scales").view(torch.float32).view(*shape[:-1], 1)
        c = PageChunk(data, scale)
        self._bytes += c.nbytes
        return c

    @property
    def nbytes(self) -> int:
        """Host bytes handed out so far."""
        return self._bytes

    def release(self) -> None:
        """Return every block and close the arena (callers must have finished all copies touching them)."""
        for block in self._blocks:
            block.free()
        self._blocks.clear()
        self._bytes = 0
        self._arena.close()


_ALIGN = ArenaConfig().alignment


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def device_chunk(layout: ChunkLayout, device: torch.device) -> PageChunk:
    """A device staging chunk with the same layout as a host chunk (contiguous copies both ways)."""
    shape = layout.shape
    data = torch.empty(shape, dtype=layout.store_dtype, device=device)
    scale = torch.empty(*shape[:-1], 1, dtype=torch.float32, device=device) if layout.fp8 else None
    return PageChunk(data, scale)
