"""Host buffers of one session: reserved once, at exact size, from a ``tidal_arena.PinnedArena``.

The optimizer asks for all its host tensors at once (:meth:`HostMemory.reserve`): the arena reserves one
slab for the whole list (page-locked once, up front: page-locking costs ~0.3-0.6 s/GiB on the GPU
machine, never per step) and carves it into per-tag blocks. On the CPU (device ``"cpu"`` standing in for
the GPU) the arena is pageable; on CUDA without CuPy the arena degrades to pageable memory, which is
recorded in the decision log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tidal_arena import ArenaConfig, PinnedArena

__all__ = ["HostMemory", "HostRequest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostRequest:
    """One tensor wanted in host memory."""

    tag: str
    """Accounting tag (``"master"``, ``"exp_avg"``, ``"grad"``, ...)."""
    dtype: torch.dtype
    """Element type."""
    numel: int
    """Number of elements (views are 1-D; callers reshape)."""


class HostMemory:
    """Host tensors for one session; pinned when the device is CUDA (and CuPy is present).

    Args:
        device: the training device (``cpu`` means pageable memory).
        record: callback ``record(kind, message, **data)`` into the decision log.
    """

    def __init__(self, device: torch.device, record: Callable[..., None]) -> None:
        self.device = device
        self._record = record
        self._arena: PinnedArena | None = None
        self._blocks: list[object] = []
        self.bytes_by_tag: dict[str, int] = {}
        self.pinned_bytes = 0

    def _get_arena(self) -> PinnedArena:
        if self._arena is None:
            cuda = self.device.type == "cuda"
            self._arena = PinnedArena(
                ArenaConfig(
                    backend="auto" if cuda else "pageable", device=self.device.index if cuda else None
                )
            )
            if cuda and self._arena.degraded_reason:
                self._record("host-memory", f"host buffers are pageable: {self._arena.degraded_reason}")
        return self._arena

    def reserve(self, requests: Sequence[HostRequest]) -> list[torch.Tensor]:
        """Allocate every request at once; returns one 1-D tensor per request (in order).

        Contents are uninitialised.
        """
        if not requests:
            return []
        arena = self._get_arena()
        align = arena.config.alignment
        sizes = [max(1, r.numel * r.dtype.itemsize) for r in requests]
        total = sum((n + align - 1) // align * align for n in sizes)
        arena.reserve(total)  # one slab for the whole list, page-locked once
        out = []
        for r, n in zip(requests, sizes):
            block = arena.alloc(n, tag=r.tag)
            self._blocks.append(block)
            out.append(block.tensor(r.dtype, (r.numel,)))
            self.bytes_by_tag[r.tag] = self.bytes_by_tag.get(r.tag, 0) + r.numel * r.dtype.itemsize
        if self.device.type == "cuda" and not arena.degraded_reason:
            self.pinned_bytes += total
        return out

    def stats(self) -> dict[str, object]:
        """Bytes per tag, total host bytes and pinned bytes."""
        return {
            "bytes_by_tag": dict(self.bytes_by_tag),
            "host_bytes": sum(self.bytes_by_tag.values()),
            "pinned_bytes": self.pinned_bytes,
        }

    def close(self) -> None:
        """Release every buffer (callers must have dropped the users of its views)."""
        if self._arena is not None:
            for b in self._blocks:
                self._arena.free(b)
            self._blocks.clear()
            self._arena.close()
            self._arena = None
