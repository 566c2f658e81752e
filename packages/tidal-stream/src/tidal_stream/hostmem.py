"""Host buffers reserved once and reused: the optimizer's, and the pool of offloaded activations.

:class:`HostMemory` — the optimizer asks for all its host tensors at once (:meth:`HostMemory.reserve`): the arena reserves one
slab for the whole list (page-locked once, up front: page-locking costs ~0.3-0.6 s/GiB on the GPU
machine, never per step) and carves it into per-tag blocks. On the CPU (device ``"cpu"`` standing in for
the GPU) the arena is pageable; on CUDA without CuPy the arena degrades to pageable memory, which is
recorded in the decision log.

:class:`ActivationHostPool` — offloaded activations come and go every step, in the same sizes and order.
Each block owns host slabs (pinned when the allocator it is given pins); a block's forward carves its
saved tensors from its slabs in order, so a repeated step lands every tensor on the same bytes as the
step before and allocates nothing: page-locking happens only while warming up (the first step, plus
one merge of a block whose first forward took several slabs), never per step. A slab is reused once
every tensor carved from it was released, and its next writer waits on the events of the copies that
last read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tidal_arena import ArenaConfig, PageLockLimitError, PinnedArena

__all__ = ["ActivationHostPool", "EventSet", "HostMemory", "HostRequest", "HostSlab"]

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
    pinned: bool = True
    """Copied to or from the device: page-locked on CUDA. False: read and written by the CPU alone (an
    optimizer's moments), so it stays pageable — no page-lock limit, no page-locking time at setup."""


class HostMemory:
    """Host tensors for one session; pinned when the device is CUDA (and CuPy is present).

    Args:
        device: the training device (``cpu`` means pageable memory).
        record: callback ``record(kind, message, **data)`` into the decision log.
    """

    def __init__(self, device: torch.device, record: Callable[..., None]) -> None:
        self.device = device
        self._record = record
        self._arenas: dict[bool, PinnedArena] = {}  # pinned? -> its arena
        self._blocks: list[tuple[PinnedArena, object]] = []
        self.bytes_by_tag: dict[str, int] = {}
        self.pinned_bytes = 0
        self.pageable_bytes = 0

    def _get_arena(self, pinned: bool) -> PinnedArena:
        if pinned not in self._arenas:
            cuda = self.device.type == "cuda" and pinned
            arena = PinnedArena(
                ArenaConfig(
                    backend="auto" if cuda else "pageable", device=self.device.index if cuda else None
                )
            )
            if cuda and arena.degraded_reason:
                self._record("host-memory", f"host buffers are pageable: {arena.degraded_reason}")
            self._arenas[pinned] = arena
        return self._arenas[pinned]

    def reserve(self, requests: Sequence[HostRequest]) -> list[torch.Tensor]:
        """Allocate every request at once; returns one 1-D tensor per request (in order).

        Requests marked ``pinned`` share one page-locked slab (on CUDA), the others one pageable slab.
        Contents are uninitialised.
        """
        out: list[torch.Tensor | None] = [None] * len(requests)
        parts = []  # (pinned, arena, request indices, their sizes, the slab's bytes)
        for pinned in (True, False):
            idx = [i for i, r in enumerate(requests) if r.pinned == pinned]
            if idx:
                arena = self._get_arena(pinned)
                align = arena.config.alignment
                sizes = {i: max(1, requests[i].numel * requests[i].dtype.itemsize) for i in idx}
                parts.append(
                    (pinned, arena, idx, sizes, sum((n + align - 1) // align * align for n in sizes.values()))
                )
        self._check_ram(sum(p[-1] for p in parts))
        for pinned, arena, idx, sizes, total in parts:
            arena.reserve(total)  # one slab for the whole list, page-locked once when pinned
            for i in idx:
                r = requests[i]
                block = arena.alloc(sizes[i], tag=r.tag)
                self._blocks.append((arena, block))
                out[i] = block.tensor(r.dtype, (r.numel,))
                self.bytes_by_tag[r.tag] = self.bytes_by_tag.get(r.tag, 0) + r.numel * r.dtype.itemsize
            if pinned and self.device.type == "cuda" and not arena.degraded_reason:
                self.pinned_bytes += total
            else:
                self.pageable_bytes += total
        return out  # type: ignore[return-value]  # every slot filled above

    def _check_ram(self, nbytes: int) -> None:
        """Refuse ``nbytes`` more when this session's host buffers, pinned and pageable together, would
        pass the host-RAM cap (each arena checks only its own slabs, and the pinned one ``ulimit -l``)."""
        held = self.pinned_bytes + self.pageable_bytes
        cap, why = self._get_arena(False).cap()
        if held + nbytes > cap:
            from tidal_plan import format_bytes

            raise PageLockLimitError(
                f"host optimizer buffers: would reserve {format_bytes(held + nbytes)} in total, above the cap "
                f"{format_bytes(cap)} set by {why}; already reserved {format_bytes(held)}. Fix: fewer parameters "
                "updated on the host (a larger vram_budget, LoRA), moment_dtype='bf16', or raise "
                "ArenaConfig.max_pinned_bytes if the machine has the RAM."
            )

    def stats(self) -> dict[str, object]:
        """Bytes per tag, total host bytes, pinned and pageable bytes."""
        return {
            "bytes_by_tag": dict(self.bytes_by_tag),
            "host_bytes": sum(self.bytes_by_tag.values()),
            "pinned_bytes": self.pinned_bytes,
            "pageable_bytes": self.pageable_bytes,
        }

    def close(self) -> None:
        """Release every buffer (callers must have dropped the users of its views)."""
        for arena, b in self._blocks:
            arena.free(b)
        self._blocks.clear()
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class EventSet:
    """Several events as one (``query``/``wait``/``synchronize`` over all of them)."""

    __slots__ = ("events",)

    def __init__(self, events: Sequence[Any]) -> None:
        self.events = list(events)

    def query(self) -> bool:
        """True once every event has completed."""
        return all(e.query() for e in self.events)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait (on the device) for every event."""
        for e in self.events:
            e.wait(stream)  # why: each guards a different earlier copy of the same bytes

    def synchronize(self) -> None:
        """Block the host until every event has completed."""
        for e in self.events:
            e.synchronize()


class HostSlab:
    """One host buffer of a block: ``tensor`` (``uint8 [nbytes]``), ``live`` carved tensors still in
    use, ``after`` the events of copies that read or wrote it since its last reuse."""

    __slots__ = ("after", "block", "handle", "live", "nbytes", "retired", "taken", "tensor")

    def __init__(self, block: int, tensor: torch.Tensor, handle: Any) -> None:
        self.block = block
        self.tensor = tensor  # uint8 [nbytes]
        self.handle = handle  # what the allocator's free takes back (None: dropping the tensor frees it)
        self.nbytes = int(tensor.numel())
        self.live = 0
        self.after: list[Any] = []
        self.taken = False  # being carved by an open forward
        self.retired = False  # the pool was closed: free at the last release


class _Cursor:
    """Carving state of one forward of one block."""

    __slots__ = ("block", "carved", "idx", "off", "slabs", "used")

    def __init__(self, block: int, slabs: list[HostSlab]) -> None:
        self.block = block
        self.slabs = slabs
        self.idx = 0
        self.off = 0
        self.carved = 0  # aligned bytes carved so far
        self.used: list[HostSlab] = []


class ActivationHostPool:
    """Host slabs per block for offloaded activations, reused step after step (see the module docstring).

    Args:
        alloc: ``alloc(nbytes, tag) -> (uint8 tensor [nbytes], handle)``; called only to grow.
        free: ``free(handle, after)`` returns a slab once ``after`` (an event, or None) has completed.
        alignment: byte alignment of every carved tensor (DMA-friendly; a multiple of every itemsize).
    """

    def __init__(
        self,
        alloc: Callable[[int, str], tuple[torch.Tensor, Any]],
        free: Callable[[Any, Any], None],
        *,
        alignment: int = 4096,
    ) -> None:
        assert alignment > 0 and alignment % 16 == 0, "alignment must cover every element size"
        self._alloc = alloc
        self._free = free
        self.alignment = alignment
        self._slabs: dict[int, list[HostSlab]] = {}
        self._merge: dict[int, tuple[list[HostSlab], int]] = {}  # fragmented forwards to merge next time
        self.hint = 0  # most bytes one block's forward carved: the size of a fresh block's first slab
        self.allocations = 0
        self.allocated_bytes = 0
        self.carves = 0

    def begin(self, block: int) -> tuple[_Cursor, list[Any]]:
        """Start carving one forward of ``block``.

        Returns:
            The cursor to pass to :meth:`carve` and :meth:`end`, and the events the first writer into
            the cursor's slabs must wait for (copies that read their previous contents).
        """
        slabs = self._slabs.setdefault(block, [])
        waits: list[Any] = []
        merge = self._merge.pop(block, None)
        if merge is not None and all(s.live == 0 and not s.taken for s in merge[0]):
            # the block's last forward took several slabs (first step, or a longer sequence): one slab
            # of the bytes it carved replaces them, so from now on its restore is one copy
            at = slabs.index(merge[0][0])
            for s in merge[0]:
                slabs.remove(s)
                self._free(s.handle, EventSet(s.after) if s.after else None)
            slabs.insert(at, self._new(block, merge[1]))
        free = [s for s in slabs if s.live == 0 and not s.taken]
        for s in free:
            s.taken = True
            waits.extend(s.after)
            s.after.clear()
        return _Cursor(block, free), waits

    def carve(self, cur: _Cursor, nbytes: int) -> tuple[HostSlab, int]:
        """Room for ``nbytes`` in the cursor's slabs: ``(slab, byte offset)``; grows when none is left."""
        while cur.idx < len(cur.slabs):
            s = cur.slabs[cur.idx]
            off = _round_up(cur.off, self.alignment)
            if off + nbytes <= s.nbytes:
                break
            cur.idx += 1
            cur.off = 0
        else:
            s = self._new(cur.block, max(nbytes, self.hint - cur.carved))
            self._slabs[cur.block].append(s)
            s.taken = True
            cur.slabs.append(s)
            cur.idx = len(cur.slabs) - 1
            off = 0
        if not cur.used or cur.used[-1] is not s:
            cur.used.append(s)
        cur.off = off + nbytes
        cur.carved += _round_up(nbytes, self.alignment)
        s.live += 1
        self.carves += 1
        return s, off

    def end(self, cur: _Cursor) -> None:
        """Close a forward's cursor: its untouched slabs are free again; remember its size."""
        for s in cur.slabs:
            s.taken = False
        self.hint = max(self.hint, cur.carved)
        if len(cur.used) > 1:
            self._merge[cur.block] = (list(cur.used), cur.carved)

    def release(self, slab: HostSlab, after: Any | None) -> None:
        """One carved tensor is no longer used; ``after`` guards the last copy that touched it."""
        slab.live -= 1
        if after is not None:
            slab.after.append(after)
            if len(slab.after) > 64:  # a slab not reused for long: keep only what has not completed
                slab.after = [e for e in slab.after if not e.query()]
        if slab.retired and slab.live == 0:
            self._free(slab.handle, EventSet(slab.after) if slab.after else None)
            slab.handle = None

    def close(self) -> None:
        """Free every slab (those still in use at their last release)."""
        for slabs in self._slabs.values():
            for s in slabs:
                s.retired = True
                if s.live == 0:
                    self._free(s.handle, EventSet(s.after) if s.after else None)
                    s.handle = None
        self._slabs.clear()
        self._merge.clear()

    def _new(self, block: int, nbytes: int) -> HostSlab:
        nbytes = _round_up(max(nbytes, 1), self.alignment)
        tensor, handle = self._alloc(nbytes, f"act.block{block}")
        assert tensor.dtype == torch.uint8 and tensor.numel() >= nbytes, "the allocator returns uint8 bytes"
        slab = HostSlab(block, tensor[:nbytes], handle)  # [nbytes]
        self.allocations += 1
        self.allocated_bytes += nbytes
        return slab

    def stats(self) -> dict[str, int]:
        """``slabs``, ``host_bytes`` (held now), ``allocations`` and ``allocated_bytes`` (since creation:
        flat after warm-up), ``carves`` (tensors placed), ``live`` (carved tensors still in use)."""
        all_slabs = [s for slabs in self._slabs.values() for s in slabs]
        return {
            "slabs": len(all_slabs),
            "host_bytes": sum(s.nbytes for s in all_slabs),
            "allocations": self.allocations,
            "allocated_bytes": self.allocated_bytes,
            "carves": self.carves,
            "live": sum(s.live for s in all_slabs),
        }
