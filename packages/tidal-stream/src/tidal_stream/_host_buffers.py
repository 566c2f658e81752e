"""Host buffers for streamed weights and offloaded activations (arena-backed or pinned ``torch.empty``).

Distinct from the optimizer's reserve-once ``hostmem.HostMemory``: weights are copied in once at setup,
activations come and go every step, so buffers are taken per tensor — from a ``tidal_arena.PinnedArena``
when one is given (page-locked once, carved per tensor), else from torch's caching pinned allocator,
which also keeps a buffer alive until the asynchronous copies reading it have finished.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tidal_stream.streams import StreamEvent

__all__ = ["HostBuffers"]

logger = logging.getLogger(__name__)


class HostBuffers:
    """Host buffers for streamed tensors: carved from a ``tidal_arena.PinnedArena`` when given, else
    ``torch.empty(..., pin_memory=pin)``.

    Args:
        device: The device the host copies feed; pinning is only meaningful for ``cuda``.
        arena: Optional arena (``.alloc(nbytes, tag=) -> Block``, ``Block.tensor(dtype, shape)``,
            ``.free(block, after=event)``).
        pin: Page-lock the buffers when no arena is given (needed for asynchronous H2D copies).
    """

    def __init__(self, device: torch.device, arena: Any | None = None, pin: bool = True) -> None:
        self.arena = arena
        self.pin = bool(pin) and device.type == "cuda" and arena is None
        self.degraded: list[str] = []
        if pin and device.type == "cuda" and not torch.cuda.is_available():  # pragma: no cover
            self.pin = False
            self.degraded.append("pin=True but CUDA is unavailable: host copies are pageable")
            logger.warning("tidal-stream: %s", self.degraded[-1])
        self._blocks: list[Any] = []
        self._own_arena = False  # the arena was created here (reserve_own_arena) and is closed here
        self._arena_full = False  # our own arena could not grow: new buffers come from torch's pool

    def empty_like(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """A host tensor with ``t``'s dtype, shape and strides; kept until :meth:`free_all`."""
        host, handle = self.alloc_like(t, tag)
        if handle is not None:
            self._blocks.append(handle)
        return host

    def alloc_like(self, t: torch.Tensor, tag: str) -> tuple[torch.Tensor, Any | None]:
        """A host tensor with ``t``'s dtype, shape and strides (``t`` dense and non-overlapping), and
        the arena block to hand to :meth:`free` (None without an arena)."""
        if self.arena is not None and not self._arena_full and t.is_contiguous() and t.numel() > 0:
            block = self.arena.alloc(t.numel() * t.element_size(), tag=tag)
            return block.tensor(t.dtype, tuple(t.shape)), block
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.pin)
        return host, None

    def reserve_own_arena(self, nbytes: int) -> None:
        """Without an arena on CUDA, page-lock ``nbytes`` more at exact size in an arena of our own (torch's
        pinned pool rounds each buffer to a power of two: up to 2x the host memory): the first call creates
        it, later calls add a slab, so host copies can be reserved block by block as their pageable
        originals are freed. Failing that (no CuPy, over the page-lock cap) the buffers not yet carved come
        from torch's pinned memory, logged and recorded."""
        if not self.pin or nbytes <= 0 or self._arena_full:
            return
        if self.arena is not None and not self._own_arena:
            return  # the caller's arena: it sized itself
        try:
            if self.arena is None:
                from tidal_arena import ArenaConfig, PinnedArena

                arena = PinnedArena(ArenaConfig(backend="cupy"))
                arena.reserve(nbytes)
                self.arena, self._own_arena = arena, True
            else:
                self.arena.reserve(nbytes)
        except Exception as e:  # any reason the arena cannot be had: stay on torch's pinned pool
            self.degraded.append(
                f"no exact-size pinned arena ({type(e).__name__}: {e}); torch pinned memory used"
            )
            logger.warning("tidal-stream: %s", self.degraded[-1])
            self._arena_full = self.arena is not None  # what it holds stays; new buffers come from torch

    def free(self, handle: Any | None, after: StreamEvent | None = None) -> None:
        """Return one arena block once ``after`` (the last copy reading it) has completed."""
        if handle is not None and self.arena is not None:
            self.arena.free(handle, after=after)

    def free_all(self, after: StreamEvent | None = None) -> None:
        """Return every block handed out by :meth:`empty_like` (after ``after`` completes)."""
        for block in self._blocks:
            self.free(block, after)
        self._blocks.clear()
        if self._own_arena and self.arena is not None:
            if after is not None:
                after.synchronize()  # the arena's memory goes away entirely: the last copy must be done
            self.arena.close()
            self.arena = None
            self._own_arena = self._arena_full = False
