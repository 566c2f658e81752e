"""`PinnedArena`: exact-size page-locked slabs carved into aligned blocks (best fit, coalescing frees).

[Note: event-guarded reuse] ``free(block, after=event)`` parks the block until ``event.query()`` is True: a
copy that still reads or writes the block's memory keeps it out of the free lists, so a later ``alloc``
can never hand the same bytes to someone else while the DMA engine is using them. Parked blocks are
re-examined at every ``alloc``, ``stats`` and ``reclaim``.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tidal_arena import _backend
from tidal_arena._backend import Slab, log_once, profile_range
from tidal_arena.config import ArenaConfig, effective_cap
from tidal_arena.errors import ArenaError, ArenaExhausted, PageLockLimitError
from tidal_arena.stats import ArenaStats, fmt_bytes

logger = logging.getLogger(__name__)

_LIVE_ARENAS: weakref.WeakSet[PinnedArena] = weakref.WeakSet()


class EventLike(Protocol):
    """Anything with ``query() -> bool``: a ``torch.cuda.Event`` or a CPU stand-in."""

    def query(self) -> bool: ...


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Block:
    """A piece of an arena's memory: ``nbytes`` long, starting ``offset`` bytes into its slab.

    Get tensors over it with :meth:`tensor`; return it with :meth:`free` (or ``arena.free``).
    """

    __slots__ = ("_arena", "_fallback", "_freed", "capacity", "nbytes", "offset", "slab", "tag")

    def __init__(
        self,
        arena: PinnedArena,
        slab: int,
        offset: int,
        capacity: int,
        nbytes: int,
        tag: str,
        fallback: torch.Tensor | None = None,
    ) -> None:
        self._arena = arena
        self.slab = slab  # index of the slab, -1 for a pageable fallback block
        self.offset = offset
        self.capacity = capacity
        self.nbytes = nbytes
        self.tag = tag
        self._fallback = fallback
        self._freed = False

    @property
    def pinned(self) -> bool:
        """True when the block's memory is page-locked."""
        return self._fallback is None and self._arena.pinned

    @property
    def freed(self) -> bool:
        """True once the block was freed (its memory may belong to someone else)."""
        return self._freed

    def _bytes(self) -> torch.Tensor:
        if self._freed:
            raise ArenaError(
                f"Block(tag={self.tag!r}, nbytes={self.nbytes}) was freed; allocate a new block."
            )
        if self._fallback is not None:
            return self._fallback
        return self._arena._slab_tensor(self.slab)[self.offset : self.offset + self.nbytes]  # [nbytes]

    @property
    def data_ptr(self) -> int:
        """Address of the block's first byte."""
        return self._bytes().data_ptr()

    def tensor(
        self, dtype: torch.dtype = torch.uint8, shape: int | Sequence[int] | None = None
    ) -> torch.Tensor:
        """A zero-copy CPU tensor over the block's memory (``is_pinned()`` on the CuPy backend).

        Args:
            dtype: element type.
            shape: the tensor's shape; ``None`` means 1-D over the whole block (``nbytes // itemsize``).

        Raises:
            ValueError: the shape needs more bytes than the block has.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Block.tensor: dtype must be a torch.dtype, got {dtype!r}.")
        item = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = (self.nbytes // item,)
        elif isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"Block.tensor: shape must be non-negative, got {shape}.")
        numel = 1
        for s in shape:
            numel *= s
        need = numel * item
        if need > self.nbytes:
            raise ValueError(
                f"Block.tensor: shape {shape} of {dtype} needs {need} bytes but the block has {self.nbytes}. "
                "Allocate a larger block or pass a smaller shape."
            )
        return self._bytes()[:need].view(dtype).view(shape)

    def free(self, after: EventLike | None = None) -> None:
        """Return the block to its arena; with ``after``, not reused before ``after.query()`` is True."""
        self._arena.free(self, after=after)

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("pinned" if self.pinned else "pageable")
        return (
            f"Block(tag={self.tag!r}, nbytes={self.nbytes}, slab={self.slab}, offset={self.offset}, {state})"
        )


class PinnedArena:
    """Page-locked host memory in exact-size slabs, carved into aligned blocks.

    Slabs are reserved through ``cudaHostAlloc`` at the size asked (rounded up to ``alignment`` only —
    torch's and CuPy's pinned pools round to powers of two). Blocks are carved best-fit; frees coalesce
    with free neighbours. Without CUDA or CuPy, ``backend="auto"`` runs on pageable memory (logged once)
    with identical allocator logic. Thread-safe.

    Attributes:
        config: the arena's configuration.
        degraded_reason: why ``backend="auto"`` runs on pageable memory ("" when it does not); logged once.

    Example:
        >>> with PinnedArena(ArenaConfig(slab_bytes=1 << 20)) as arena:
        ...     blk = arena.alloc(4096, tag="grads")
        ...     t = blk.tensor(torch.float32, (32, 32))
        ...     blk.free()
    """

    def __init__(self, config: ArenaConfig | None = None) -> None:
        if config is None:
            config = ArenaConfig()
        if not isinstance(config, ArenaConfig):
            raise TypeError(
                f"PinnedArena: config must be an ArenaConfig or None, got {type(config).__name__}."
            )
        self.config = config
        self._runtime = None
        self.degraded_reason = ""  # why "auto" runs on pageable memory ("" when it does not)
        if config.backend != "pageable":
            runtime, why = _backend.cupy_runtime()
            if runtime is None and config.backend == "cupy":
                raise ArenaError(
                    f"ArenaConfig.backend='cupy' but {why}. Fix: install tidal-arena[cuda12] or [cuda13] on a "
                    "CUDA machine, or pass backend='auto' / 'pageable'."
                )
            if runtime is None:
                self.degraded_reason = why
                log_once("arena-pageable", "tidal-arena: %s; arenas use pageable host memory", why)
            self._runtime = runtime
        self._lock = threading.RLock()
        self._slabs: list[Slab | None] = []
        self._free_sorted: list[tuple[int, int, int]] = []  # (size, slab, offset), best fit = bisect
        self._starts: list[dict[int, int]] = []  # per slab: free offset -> size
        self._ends: list[dict[int, int]] = []  # per slab: free end -> offset
        self._pending: list[tuple[Block, EventLike]] = []
        self._by_tag: dict[str, int] = {}
        self._reserved = self._used = self._pending_bytes = self._peak = 0
        self._blocks = self._fallbacks = self._fallback_bytes = 0
        self._lock_calls = 0
        self._lock_seconds = 0.0
        self._closed = False
        _LIVE_ARENAS.add(self)

    # -- properties ------------------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        """True when the arena's slabs are page-locked (CuPy backend)."""
        return self._runtime is not None

    @property
    def backend(self) -> str:
        """``"cupy"`` or ``"pageable"``: the backend in use after resolving ``"auto"``."""
        return "cupy" if self.pinned else "pageable"

    def cap(self) -> tuple[int, str]:
        """The current cap on reserved bytes and which limit binds (see :func:`effective_cap`)."""
        return effective_cap(self.config, self.pinned)

    # -- slabs -----------------------------------------------------------------------------------
    def _slab_tensor(self, index: int) -> torch.Tensor:
        slab = self._slabs[index] if 0 <= index < len(self._slabs) else None
        if slab is None:
            raise ArenaError("PinnedArena: the arena was closed; its blocks are no longer valid.")
        return slab.tensor

    def _add_slab(self, nbytes: int) -> int:
        """Reserve a slab of exactly ``nbytes`` (already aligned) and make it one free extent."""
        if self._runtime is not None:
            slab = _backend.alloc_pinned_slab(self._runtime, nbytes, self.config.device)
            self._lock_calls += 1
            self._lock_seconds += slab.lock_seconds
            logger.debug("tidal-arena: page-locked %s in %.3f s", fmt_bytes(nbytes), slab.lock_seconds)
        else:
            slab = _backend.alloc_pageable_slab(nbytes, self.config.alignment)
        index = len(self._slabs)
        self._slabs.append(slab)
        self._starts.append({})
        self._ends.append({})
        self._reserved += nbytes
        self._put_free(index, 0, nbytes)
        return index

    def reserve(self, nbytes: int) -> None:
        """Reserve a slab of ``nbytes`` (rounded up to ``alignment`` only) now, rather than at first need.

        Page-locking is slow (about 0.6 s/GiB): reserve up front, never per step.

        Raises:
            PageLockLimitError: the slab would take the arena past its cap (``max_pinned_bytes`` / ``ulimit -l``).
        """
        _check_nbytes("PinnedArena.reserve", nbytes)
        size = _round_up(nbytes, self.config.alignment)
        with self._lock:
            self._check_open()
            cap, why = self.cap()
            if self._reserved + size > cap:
                raise PageLockLimitError(
                    f"PinnedArena.reserve({nbytes}): would reserve {fmt_bytes(self._reserved + size)} in total, "
                    f"above the cap {fmt_bytes(cap)} set by {why}; already reserved "
                    f"{fmt_bytes(self._reserved)}. Fix: raise ArenaConfig.max_pinned_bytes (and ulimit -l) or "
                    "reserve less."
                )
            with profile_range("tidal::arena.reserve"):
                self._add_slab(size)

    # -- free lists ------------------------------------------------------------------------------
    def _put_free(self, slab: int, offset: int, size: int) -> None:
        """Insert a free extent, coalescing with free neighbours in the same slab."""
        starts, ends = self._starts[slab], self._ends[slab]
        prev = ends.pop(offset, None)
        if prev is not None:
            psize = starts.pop(prev)
            self._remove_sorted(psize, slab, prev)
            offset, size = prev, size + psize
        nsize = starts.pop(offset + size, None)
        if nsize is not None:
            del ends[offset + size + nsize]
            self._remove_sorted(nsize, slab, offset + size)
            size += nsize
        starts[offset] = size
        ends[offset + size] = offset
        bisect.insort(self._free_sorted, (size, slab, offset))

    def _remove_sorted(self, size: int, slab: int, offset: int) -> None:
        i = bisect.bisect_left(self._free_sorted, (size, slab, offset))
        assert self._free_sorted[i] == (size, slab, offset), "free index out of sync"
        del self._free_sorted[i]

    def _take(self, size: int) -> tuple[int, int] | None:
        """Best fit: the smallest free extent ≥ size (lowest slab/offset on ties); split off the rest."""
        i = bisect.bisect_left(self._free_sorted, (size, -1, -1))
        if i == len(self._free_sorted):
            return None
        fsize, slab, offset = self._free_sorted.pop(i)
        del self._starts[slab][offset]
        del self._ends[slab][offset + fsize]
        if fsize > size:
            rest = (offset + size, fsize - size)
            # the extent's neighbours are allocated (else they would have coalesced): no merge needed
            self._starts[slab][rest[0]] = rest[1]
            self._ends[slab][rest[0] + rest[1]] = rest[0]
            bisect.insort(self._free_sorted, (rest[1], slab, rest[0]))
        return slab, offset

    def _reclaim_locked(self) -> int:
        """Move parked blocks whose event completed into the free lists; returns the bytes reclaimed."""
        if not self._pending:
            return 0
        still: list[tuple[Block, EventLike]] = []
        got = 0
        for blk, ev in self._pending:
            if ev.query():
                self._put_free(blk.slab, blk.offset, blk.capacity)
                got += blk.capacity
            else:
                still.append((blk, ev))
        self._pending = still
        self._pending_bytes -= got
        return got

    def reclaim(self, wait: bool = False) -> int:
        """Return parked blocks whose copy finished to the free lists.

        Args:
            wait: first wait for every parked block's event (``synchronize()`` where the event has it,
                else poll ``query()``).

        Returns:
            Bytes moved back to the free lists.
        """
        if wait:
            with self._lock:
                events = [ev for _, ev in self._pending]
            for ev in events:  # wait outside the lock: other threads keep allocating meanwhile
                sync = getattr(ev, "synchronize", None)
                if callable(sync):
                    sync()
                else:
                    while not ev.query():
                        time.sleep(1e-4)
        with self._lock:
            return self._reclaim_locked()

    # -- alloc / free ----------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, tag: str = "") -> Block:
        """A block of at least ``nbytes``, starting on an ``alignment`` boundary.

        Grows by a new slab of ``max(slab_bytes, nbytes)`` (within the cap) when no free block fits.

        Args:
            nbytes: bytes needed (≥ 1).
            tag: accounting label (``stats().by_tag``).

        Raises:
            ArenaExhausted: nothing fits and the cap forbids growing (and ``on_limit="error"``).
        """
        _check_nbytes("PinnedArena.alloc", nbytes)
        if not isinstance(tag, str):
            raise TypeError(f"PinnedArena.alloc: tag must be a str, got {type(tag).__name__} {tag!r}.")
        size = _round_up(nbytes, self.config.alignment)
        with profile_range("tidal::arena.alloc"), self._lock:
            self._check_open()
            self._reclaim_locked()
            hit = self._take(size)
            if hit is None:
                try:
                    hit = self._grow(size)
                except PageLockLimitError:
                    if self.config.on_limit != "pageable":
                        raise
                    # the driver refused to lock more: that is the budget's end too, so fall back
                    hit = None
            if hit is None:
                blk = self._fallback_or_raise(nbytes, size, tag)
            else:
                blk = Block(self, hit[0], hit[1], size, nbytes, tag)
            self._used += blk.capacity
            self._peak = max(self._peak, self._used)
            self._blocks += 1
            self._by_tag[tag] = self._by_tag.get(tag, 0) + blk.capacity
            return blk

    def _grow(self, size: int) -> tuple[int, int] | None:
        cap, _ = self.cap()
        room = cap - self._reserved
        if room < size:
            return None
        want = max(_round_up(self.config.slab_bytes, self.config.alignment), size)
        slab_size = min(want, room // self.config.alignment * self.config.alignment)
        index = self._add_slab(slab_size)
        hit = self._take(size)
        assert hit is not None and hit[0] == index, "a fresh slab must fit the request"
        return hit

    def _fallback_or_raise(self, nbytes: int, size: int, tag: str) -> Block:
        cap, why = self.cap()
        if self.config.on_limit == "pageable":
            if not self._fallbacks:  # warn once per arena; every fallback is counted
                logger.warning(
                    "tidal-arena: cap %s (%s) reached; serving allocations from pageable memory "
                    "(counted in stats().fallbacks)",
                    fmt_bytes(cap),
                    why,
                )
            self._fallbacks += 1
            self._fallback_bytes += size
            mem = _backend.alloc_pageable_slab(size, self.config.alignment).tensor[:nbytes]  # [nbytes]
            return Block(self, -1, 0, size, nbytes, tag, fallback=mem)
        free = self._reserved - self._used - self._pending_bytes
        largest = self._free_sorted[-1][0] if self._free_sorted else 0
        raise ArenaExhausted(
            f"PinnedArena.alloc: cannot allocate {fmt_bytes(nbytes)} (tag {tag!r}, {size} B aligned): "
            f"free {fmt_bytes(free)}, largest free block {fmt_bytes(largest)}, "
            f"{fmt_bytes(self._pending_bytes)} waiting for their copy's event; reserved "
            f"{fmt_bytes(self._reserved)} of the cap {fmt_bytes(cap)} set by {why}. Fix: free blocks "
            "(arena.reclaim(wait=True) for those waiting on copies), raise ArenaConfig.max_pinned_bytes, "
            "or pass ArenaConfig(on_limit='pageable') to fall back to pageable memory."
        )

    def free(self, block: Block, *, after: EventLike | None = None) -> None:
        """Return ``block``. With ``after``, its memory is not reused until ``after.query()`` is True.

        Args:
            block: a live block of this arena.
            after: an object with ``query() -> bool`` (a ``torch.cuda.Event`` recorded after the last copy
                that reads or writes the block, or a CPU stand-in). See [Note: event-guarded reuse].
        """
        if not isinstance(block, Block) or block._arena is not self:
            raise ValueError(f"PinnedArena.free: block must be a Block of this arena, got {block!r}.")
        if after is not None and not callable(getattr(after, "query", None)):
            raise TypeError(
                f"PinnedArena.free: after must have a query() -> bool method (a torch.cuda.Event), "
                f"got {type(after).__name__}."
            )
        with profile_range("tidal::arena.free"), self._lock:
            if block._freed:
                raise ArenaError(f"PinnedArena.free: {block!r} was already freed (double free).")
            block._freed = True
            self._used -= block.capacity
            self._blocks -= 1
            left = self._by_tag[block.tag] - block.capacity
            if left:
                self._by_tag[block.tag] = left
            else:
                del self._by_tag[block.tag]
            if block._fallback is not None:
                self._fallback_bytes -= block.capacity
                block._fallback = None
                return
            if self._closed:
                return
            if after is None or after.query():
                self._put_free(block.slab, block.offset, block.capacity)
            else:
                self._pending.append((block, after))
                self._pending_bytes += block.capacity

    # -- stats / lifetime --------------------------------------------------------------------------
    def stats(self) -> ArenaStats:
        """A consistent snapshot of the arena's accounting (parked blocks whose event completed count as free)."""
        with self._lock:
            self._reclaim_locked()
            free = self._reserved - self._used + self._fallback_bytes - self._pending_bytes
            largest = self._free_sorted[-1][0] if self._free_sorted else 0
            assert free == sum(s for s, _, _ in self._free_sorted), "free accounting out of sync"
            return ArenaStats(
                backend=self.backend,
                pinned=self.pinned,
                reserved_bytes=self._reserved,
                used_bytes=self._used,
                free_bytes=free,
                pending_bytes=self._pending_bytes,
                largest_free_block=largest,
                fragmentation=(1.0 - largest / free) if free else 0.0,
                cap_bytes=self.cap()[0],
                slabs=sum(s is not None for s in self._slabs),
                blocks=self._blocks,
                peak_used_bytes=self._peak,
                fallbacks=self._fallbacks,
                fallback_bytes=self._fallback_bytes,
                page_lock_calls=self._lock_calls,
                page_lock_seconds=self._lock_seconds,
                by_tag=dict(self._by_tag),
                degraded_reason=self.degraded_reason,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaError("PinnedArena: the arena is closed; create a new one.")

    def close(self) -> None:
        """Release the slabs. Tensors still viewing them keep their memory alive until they are dropped."""
        with self._lock:
            if self._closed:
                return
            if self._blocks:
                logger.info(
                    "tidal-arena: closing with %d live block(s); their tensors stay valid", self._blocks
                )
            self._closed = True
            self._slabs = [None] * len(self._slabs)
            self._free_sorted.clear()
            self._pending.clear()
            self._reserved = self._pending_bytes = 0
        _LIVE_ARENAS.discard(self)

    def __enter__(self) -> PinnedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedArena(backend={self.backend!r}, reserved={self._reserved}, used={self._used})"


def _check_nbytes(where: str, nbytes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"{where}: nbytes must be an int, got {type(nbytes).__name__} {nbytes!r}.")
    if nbytes < 1:
        raise ValueError(f"{where}: nbytes must be >= 1, got {nbytes}.")


def arena_stats() -> dict[str, Any]:
    """Accounting summed over every live arena, plus in-place pinning (``pin_``) counters.

    Returns:
        A dict with the numeric :class:`ArenaStats` fields summed, ``by_tag`` merged, ``arenas`` (count),
        ``largest_free_block`` (max over arenas) and ``pin_*`` counters.
    """
    total: dict[str, Any] = {
        "arenas": 0,
        "reserved_bytes": 0,
        "pinned_reserved_bytes": 0,
        "used_bytes": 0,
        "free_bytes": 0,
        "pending_bytes": 0,
        "largest_free_block": 0,
        "peak_used_bytes": 0,
        "blocks": 0,
        "fallbacks": 0,
        "fallback_bytes": 0,
        "page_lock_calls": 0,
        "page_lock_seconds": 0.0,
        "by_tag": {},
    }
    for arena in list(_LIVE_ARENAS):
        s = arena.stats()
        total["arenas"] += 1
        for key in (
            "reserved_bytes",
            "used_bytes",
            "free_bytes",
            "pending_bytes",
            "peak_used_bytes",
            "blocks",
            "fallbacks",
            "fallback_bytes",
            "page_lock_calls",
            "page_lock_seconds",
        ):
            total[key] += getattr(s, key)
        if s.pinned:
            total["pinned_reserved_bytes"] += s.reserved_bytes
        total["largest_free_block"] = max(total["largest_free_block"], s.largest_free_block)
        for tag, n in s.by_tag.items():
            total["by_tag"][tag] = total["by_tag"].get(tag, 0) + n
    total.update(_backend.pin_counters())
    return total
