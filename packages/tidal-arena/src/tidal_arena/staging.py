"""`StagingRing`: stream pageable tensors to the GPU through a few page-locked slots.

A copy from pageable memory is synchronous and slow (the driver stages it through its own small
buffer). The ring instead has worker threads copy each slot-sized chunk of the source into a free
page-locked slot, then issue the asynchronous H2D copy from that slot on a stream; host copies of the
next chunks overlap the DMA of the previous ones. On ``device="cpu"`` the same chunking runs
synchronously (CI checks the logic there).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tidal_arena._backend import CompletedEvent, profile_range
from tidal_arena.arena import PinnedArena
from tidal_arena.config import ArenaConfig, MiB
from tidal_arena.errors import ArenaError

logger = logging.getLogger(__name__)


def _check_pos_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StagingRing: {name} must be an int >= 1, got {value!r}.")
    return value


class StagingRing:
    """N page-locked slots and worker threads that stream pageable CPU tensors to a device.

    Args:
        slots: number of slots (copies in flight at once). Default 4.
        slot_bytes: bytes per slot; larger tensors are chunked. Default 64 MiB.
        device: target device: ``"cuda"``, ``"cuda:N"``, or ``"cpu"`` (synchronous, for tests).
        workers: threads filling slots in parallel. Default 2.
        arena: carve the slots from this arena instead of a private one.

    Example:
        >>> ring = StagingRing(slots=4, slot_bytes=64 << 20, device="cuda")
        >>> x_gpu, ev = ring.to_device(torch.randn(1 << 26))
        >>> torch.cuda.current_stream().wait_event(ev)  # before using x_gpu on the current stream
    """

    def __init__(
        self,
        slots: int = 4,
        slot_bytes: int = 64 * MiB,
        device: str | torch.device = "cuda",
        workers: int = 2,
        *,
        arena: PinnedArena | None = None,
    ) -> None:
        self.slots = _check_pos_int("slots", slots)
        self.slot_bytes = _check_pos_int("slot_bytes", slot_bytes)
        self.workers = _check_pos_int("workers", workers)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"StagingRing: device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}."
            ) from exc
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"StagingRing: device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}.")
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            if not torch.cuda.is_available():
                raise ArenaError(
                    f"StagingRing: device={device!r} but torch sees no CUDA device. Pass device='cpu' "
                    "(synchronous) or run on a CUDA machine."
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        if arena is None:
            backend = "auto" if self._cuda else "pageable"
            arena = PinnedArena(ArenaConfig(backend=backend, slab_bytes=self.slots * self.slot_bytes))
            self._own_arena = True
        else:
            self._own_arena = False
        self.arena = arena
        self._blocks = [arena.alloc(self.slot_bytes, tag="staging") for _ in range(self.slots)]
        self._slot = [b.tensor(torch.uint8) for b in self._blocks]  # each [slot_bytes] uint8
        self._slot_event: list[Any] = [None] * self.slots
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.slots):
            self._free.put(i)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="tidal-staging")
        self._stream: torch.cuda.Stream | None = None
        if self._cuda:
            # why: the ring's H2D copies run off the caller's stream so they overlap its compute
            self._stream = torch.cuda.Stream(device=self.device)
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        """True when the slots are page-locked (the H2D copies are then truly asynchronous)."""
        return self.arena.pinned

    def _stage(
        self, slot: int, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> None:
        """Copy ``src`` (pageable bytes) into ``slot`` and issue ``slot -> dst`` on ``stream``."""
        buf = self._slot[slot][: src.numel()]  # [chunk] uint8
        prev = self._slot_event[slot]
        if prev is not None:
            prev.synchronize()  # why: the slot's previous H2D copy must finish reading it before we overwrite
        with profile_range("tidal::staging.fill"):
            buf.copy_(src)
        if stream is None:
            dst.copy_(buf)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            dst.copy_(buf, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)  # why: marks when this slot is free to be refilled
        self._slot_event[slot] = ev

    def _run_chunk(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        slot = self._free.get()  # blocks until a slot is free: bounds the bytes in flight
        try:
            self._stage(slot, src, dst, stream)
        finally:
            self._free.put(slot)

    def to_device(
        self,
        src: torch.Tensor,
        out: torch.Tensor | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Copy a (pageable) CPU tensor to the ring's device through the pinned slots.

        Returns once every byte of ``src`` sits in a slot or on the device (``src`` may then be modified);
        the device copies may still be in flight: wait on the returned event before reading the result.

        Args:
            src: CPU tensor (non-contiguous tensors are made contiguous first: one extra host copy).
            out: destination with ``src``'s shape and dtype on the ring's device; allocated when None.
            stream: CUDA stream for the H2D copies; the ring's own stream when None.

        Returns:
            ``(device_tensor, event)``: the event (``query()``, ``synchronize()``, ``wait(stream)``) completes
            when the whole tensor has landed.
        """
        if self._closed:
            raise ArenaError("StagingRing.to_device: the ring is closed; create a new one.")
        if not isinstance(src, torch.Tensor) or src.device.type != "cpu":
            got = src.device if isinstance(src, torch.Tensor) else type(src).__name__
            raise ValueError(f"StagingRing.to_device: src must be a CPU tensor, got {got}.")
        src = src.contiguous()
        if out is None:
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        elif (
            not isinstance(out, torch.Tensor)
            or out.shape != src.shape
            or out.dtype != src.dtype
            or out.device != self.device
            or not out.is_contiguous()
        ):
            desc = (out.shape, out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"StagingRing.to_device: out must be a contiguous tensor of shape {tuple(src.shape)}, dtype "
                f"{src.dtype} on {self.device}, got {desc}. Pass out=None to allocate it."
            )
        src_b = src.reshape(-1).view(torch.uint8)  # [nbytes]
        out_b = out.reshape(-1).view(torch.uint8)  # [nbytes]
        n = src_b.numel()
        if self._cuda and stream is None:
            stream = self._stream
        if self._cuda:
            assert stream is not None
            # why: `out` may have been allocated (or last used) on the caller's stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with profile_range("tidal::staging.to_device"):
            if self._cuda and src.is_pinned():  # already page-locked: one async copy, no staging
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    out_b.copy_(src_b, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)  # why: completes when the direct copy landed
                return out, done
            spans = [(a, min(a + self.slot_bytes, n)) for a in range(0, n, self.slot_bytes)]
            if not self._cuda:
                for a, b in spans:
                    self._run_chunk(src_b[a:b], out_b[a:b], None)
                return out, CompletedEvent()
            futures = [self._pool.submit(self._run_chunk, src_b[a:b], out_b[a:b], stream) for a, b in spans]
            for f in futures:
                f.result()
            done = torch.cuda.Event()
            done.record(stream)  # why: completes after every chunk's copy (all were issued on this stream)
            return out, done

    def close(self) -> None:
        """Stop the workers, wait for in-flight copies and return the slots."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for i, blk in enumerate(self._blocks):
            ev = self._slot_event[i]
            blk.free(after=ev)  # why: a slot is reusable by the arena only after its last copy finished
        self._slot.clear()
        if self._own_arena:
            self.arena.reclaim(wait=True)
            self.arena.close()

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
