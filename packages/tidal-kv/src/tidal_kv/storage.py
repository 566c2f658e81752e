"""Host page blocks (from the tidal-arena pinned arena) and the quantized page formats (FP8, NF4).

A *chunk* is ``chunk_pages`` pages of one offloaded layer laid out like the device K/V,
``[2 (K/V), B, H, chunk_pages · page_tokens, D]``: any run of full pages inside a chunk is ``2·B·H`` evenly
spaced rows on both sides, so it moves host<->device in one strided copy (:class:`tidal_arena.RowCopy`):
native pages straight into a device slot's token range, quantized pages (and their scales, laid out the same
way) into a staging chunk they are dequantized from, into the slot; no permute on the device either way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tidal_arena import ArenaConfig, ArenaError, Block, PinnedArena
from tidal_kv.errors import KVCacheError
from tidal_quant import nf4_decode_rows, nf4_decode_rows_into, nf4_encode_rows

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALE_FLOOR = 1e-12  # keeps an all-zero (token, head) row from dividing by zero
NF4_BLOCK = 32
"""Elements per absmax scale of "nf4" pages (four per 128-wide head row). Half bitsandbytes' weight block: K
rows carry outlier channels, and on rows with a few channels 5-20x the rest, 32-element blocks kept 2 dB more
signal than 64-element ones for 4 bytes more per row (72 against 68 of bf16's 256, with 16-bit scales)."""


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


def encode_pages(kv: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[..., D]`` in a quantized page format: ``(data, scale)`` shaped like a chunk's fields.

    "fp8": :func:`quantize_fp8`. "nf4": tidal-quant's NF4 codes (bitsandbytes' bytes: two per byte, the even
    element in the high nibble) ``[..., D / 2]`` uint8 and one absmax per :data:`NF4_BLOCK` elements,
    ``[..., D / NF4_BLOCK]`` in ``kv``'s dtype (see :attr:`ChunkLayout.scale_dtype`).
    """
    if storage == "fp8":
        return quantize_fp8(kv)
    return nf4_encode_rows(kv, NF4_BLOCK)


def decode_pages(data: torch.Tensor, scale: torch.Tensor, storage: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_pages`: a new ``[..., D]`` tensor of ``dtype``."""
    if storage == "fp8":
        return dequantize_fp8(data, scale, dtype)
    return nf4_decode_rows(data, scale, NF4_BLOCK, dtype)


@dataclass
class PageChunk:
    """One host (or device-staging) chunk: page data plus, for quantized formats, per-row scales."""

    data: torch.Tensor
    """``[2, B, H, C·P, D]`` in the K/V dtype ("native") or float8_e4m3fn ("fp8"); ``[2, B, H, C·P, D / 2]``
    packed uint8 ("nf4")."""
    scale: torch.Tensor | None
    """float32 ``[2, B, H, C·P, 1]`` ("fp8") or ``[2, B, H, C·P, D / NF4_BLOCK]`` in the K/V dtype ("nf4");
    None for "native"."""

    @property
    def storage(self) -> str:
        """The page format, told by the data's dtype."""
        return _STORAGE_OF.get(self.data.dtype, "native")

    def tokens(self, start: int, stop: int) -> PageChunk:
        """The token range ``[start, stop)`` of every (K/V, sequence, head) row: evenly spaced rows."""
        scale = self.scale[:, :, :, start:stop] if self.scale is not None else None
        return PageChunk(self.data[:, :, :, start:stop], scale)

    def store(self, kv: torch.Tensor) -> None:
        """Fill this (device staging) chunk from ``kv`` ``[2, B, H, T, D]`` of its shape, in its format.

        For quantized storage ``kv`` is then overwritten with what the stored pages dequantize to, so a slot
        holds what a later gather of these pages returns, whichever slot serves the layer next.
        """
        if self.scale is None:
            self.data.copy_(kv)
            return
        storage = self.storage
        q, scale = encode_pages(kv, storage)
        self.data.copy_(q)
        self.scale.copy_(scale)
        kv.copy_(decode_pages(q, scale, storage, kv.dtype))

    def packed(self, tokens: int, start: int = 0) -> PageChunk:
        """``tokens`` of every row packed into this buffer (and its scales) where a packed ``[2, B, H, start, ·]``
        would end: a contiguous staging view, ``[2, B, H, tokens, ·]``. Views of disjoint token ranges
        ``[start, start + tokens)`` do not overlap, so a gather's runs can be staged side by side."""
        scale = _packed(self.scale, tokens, start) if self.scale is not None else None
        return PageChunk(_packed(self.data, tokens, start), scale)

    def decoder(self, dst: torch.Tensor) -> Callable[[], Any]:
        """A reusable dequantization of this (device, contiguous) quantized chunk into ``dst``, the
        ``[2, B, H, T, D]`` token range of a slot, in place: one call per gather of the same pages."""
        if self.storage == "nf4":
            return nf4_decode_rows_into(dst, self.data, self.scale, NF4_BLOCK)
        data, scale = self.data, self.scale

        def fp8() -> None:
            # the e4m3 -> K/V dtype copy is exact and the fp32 multiply rounds once: dequantize_fp8's result
            # in two kernels, without temporaries
            dst.copy_(data)
            dst.mul_(scale)

        return fp8

    @property
    def nbytes(self) -> int:
        """Bytes held by this chunk."""
        n = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n


def _packed(t: torch.Tensor, tokens: int, start: int = 0) -> torch.Tensor:
    """``[2, B, H, tokens, C]`` in ``t`` ``[2, B, H, T, C]``'s memory from element ``2·B·H·start·C`` on
    (contiguous)."""
    two, b, h, _, c = t.shape
    row = two * b * h * c
    return t.view(-1)[row * start : row * (start + tokens)].view(two, b, h, tokens, c)


_STORAGE_OF = {FP8_DTYPE: "fp8", torch.uint8: "nf4"}


def balanced_chunk_pages(pages: int, most: int) -> int:
    """Pages per host chunk for ``pages`` of capacity, at most ``most`` (``_CHUNK_BYTES`` worth): as few chunks
    as that allows, evenly filled, so the last one is not mostly empty (17 pages in chunks of 13 would
    page-lock 26 pages of host memory; in two chunks of 9, 18)."""
    most = max(1, min(pages, most))
    chunks = -(-pages // most)
    return -(-pages // chunks)


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
    storage: str = "native"
    """Page format: "native" (``dtype``), "fp8" (e4m3 + one fp32 scale per row) or "nf4" (packed NF4 + one
    absmax per :data:`NF4_BLOCK` elements, in ``dtype``)."""

    @property
    def quantized(self) -> bool:
        """Whether the pages carry scales (and are dequantized from a device staging chunk)."""
        return self.storage != "native"

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``[2 (K/V), B, H, C·P, D]``: the K/V the chunk holds."""
        return (2, self.batch, self.heads, self.chunk_pages * self.page_tokens, self.head_dim)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The page data's shape: :attr:`shape`, with ``D / 2`` packed bytes per row for "nf4"."""
        return (*self.shape[:-1], self.head_dim // 2 if self.storage == "nf4" else self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The scales' shape (last dim 0 for "native")."""
        cols = {"native": 0, "fp8": 1, "nf4": self.head_dim // NF4_BLOCK}[self.storage]
        return (*self.shape[:-1], cols)

    @property
    def store_dtype(self) -> torch.dtype:
        """The dtype the page data is stored in."""
        return {"native": self.dtype, "fp8": FP8_DTYPE, "nf4": torch.uint8}[self.storage]

    @property
    def scale_dtype(self) -> torch.dtype:
        """The scales' dtype: fp32 for "fp8"; the K/V dtype for "nf4".

        An NF4 block's absmax is the magnitude of one of its values, so the K/V dtype holds it exactly: the
        pages decode to the same values as with fp32 scales, and 16-bit scales take 8 of a 128-wide row's 72
        bytes instead of 16 of 80 (10 % fewer bytes on the link). fp8 keeps fp32: its scale is absmax / 448,
        which a 16-bit dtype would round (or fp16 flush to zero), and one 4-byte scale is 3 % of a 132-byte row.
        """
        return self.dtype if self.storage == "nf4" else torch.float32

    @property
    def data_bytes(self) -> int:
        """Bytes of the page data."""
        return math.prod(self.data_shape) * self.store_dtype.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scales (0 for "native")."""
        return math.prod(self.scale_shape) * self.scale_dtype.itemsize


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
        """Host bytes of one chunk (data + scales), each part rounded up to the arena alignment."""
        return _round_up(layout.data_bytes) + _round_up(layout.scale_bytes)

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
        data = self._raw(layout.data_bytes, "kv-pages").view(layout.store_dtype).view(layout.data_shape)
        scale = None
        if layout.quantized:
            scale = (
                self._raw(layout.scale_bytes, "kv-scales").view(layout.scale_dtype).view(layout.scale_shape)
            )
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
    data = torch.empty(layout.data_shape, dtype=layout.store_dtype, device=device)
    scale = (
        torch.empty(layout.scale_shape, dtype=layout.scale_dtype, device=device) if layout.quantized else None
    )
    return PageChunk(data, scale)
