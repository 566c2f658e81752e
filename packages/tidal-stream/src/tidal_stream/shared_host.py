"""One host copy of frozen weights per machine, shared by every local rank through POSIX shared memory.

Local rank 0 creates a file in a tmpfs (``/dev/shm``), maps it ``MAP_SHARED`` (``torch.from_file(...,
shared=True)``) and copies the frozen tensors into it; after a barrier the other local ranks map the same
file; every rank then points its frozen parameters at views of its mapping (the Parameter objects stay;
their private copies are freed) and, after a second barrier, local rank 0 unlinks the file — the mappings
stay valid while referenced, and nothing is left in ``/dev/shm`` when the job ends or crashes later.

Accounting: the copy's bytes are counted once per machine (on local rank 0); :meth:`SharedHostCopy.smaps`
reads the kernel's view of this process's mapping (``Rss``: resident pages it maps, ``Pss``: its
proportional share), so the local ranks' ``Pss`` add up to the copy's resident size once.

[Note: placeholders on the meta device] only local rank 0 needs the frozen weights in memory: the other
local ranks may hold them on the meta device (e.g. a model built under ``torch.device("meta")`` with
its trainable weights and buffers materialized). Their Parameters are replaced by host ones viewing the
mapping (in every module that holds them), so a machine needs host RAM for one copy of the frozen weights
however many GPUs it trains on — a 72B bf16 base (145 GB) on a 256 GiB machine. Local rank 0 points
each parameter at the mapping as soon as it is copied there, so its private copy is freed tensor by
tensor and its peak is one copy plus one tensor.

[Note: frozen means read-only] every local rank reads the same pages: writing a shared frozen weight in
place changes it on every rank of the machine. Frozen weights must be identical on every rank (they are
not broadcast); each machine's local rank 0 fills its copy from its own model.

Streamed blocks: the copy is placed before weight streaming is installed, and ``StreamedBlocks`` reads
the frozen tensors it finds in the mapping in place (``adopt_host=copy.owns``) instead of copying them
into private host buffers, so a rank holds no second copy of its streamed frozen weights.
:meth:`SharedHostCopy.release` (at ``unwrap()``) drops this object's reference to the mapping; the
kernel unmaps it once no tensor views it any more.

On CUDA (:meth:`SharedHostCopy.settle`, after weight streaming is installed and resident weights moved to
the device): the tensors no local rank reads from the host any more (the resident ones, now on the GPU)
give their pages back to the kernel (``madvise(MADV_REMOVE)`` punches them out of the tmpfs file for
every mapper), and every rank page-locks the runs of pages still read (``cudaHostRegister`` of each run,
``tidal_arena.pin_(view=True)``) so the streamed blocks' copies from the mapping are asynchronous DMA at
the full host link. Every run is registered once per process; a copy never spans two runs, because a
tensor lies inside one run.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["SharedHostCopy"]

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes; every tensor starts aligned (any dtype's view of the byte buffer is legal)
_PAGE = mmap.PAGESIZE
_MADV_REMOVE = 9  # linux/mman.h: free the range's backing store (tmpfs: punch a hole in the file)


def page_runs(
    spans: Iterable[tuple[int, int]], total: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split ``[0, total)`` (rounded up to whole pages) into the page runs that cover ``spans`` and the rest.

    Args:
        spans: ``(start, end)`` byte ranges in use.
        total: the mapping's bytes.

    Returns:
        ``(used, free)``: sorted, disjoint ``(start, end)`` page-aligned byte ranges; ``used`` covers every
        span (a page touched by a span is used), ``free`` is the complement.
    """
    used: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        lo, hi = a // _PAGE * _PAGE, -(-b // _PAGE) * _PAGE
        if used and lo <= used[-1][1]:
            used[-1] = (used[-1][0], max(used[-1][1], hi))  # touching or overlapping pages: one run
        else:
            used.append((lo, hi))
    free, at, end = [], 0, -(-total // _PAGE) * _PAGE
    for lo, hi in used:
        if lo > at:
            free.append((at, lo))
        at = hi
    if at < end:
        free.append((at, end))
    return used, free


def _bind(owners: list[tuple[nn.Module, str]], t: torch.Tensor, view: torch.Tensor) -> None:
    """Point the frozen parameter ``t`` at ``view``: its data (the Parameter object stays, its private
    storage is freed), or, for a placeholder on the meta device, a new host Parameter in every holder."""
    if not t.is_meta:
        t.data = view
        return
    new = nn.Parameter(view, requires_grad=False)  # a meta tensor's data cannot be replaced by a host one
    for mod, name in owners:
        mod._parameters[name] = new


def _check_room(shm_dir: str, total: int) -> None:
    """The tmpfs at ``shm_dir`` has room for ``total`` bytes, or a :class:`DistributedError` says how much."""
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if free < total:
        from tidal_stream.distributed import DistributedError

        raise DistributedError(
            f"shared host copy: {shm_dir} has {free / 2**30:.2f} GiB free, the copy needs {total / 2**30:.2f} "
            "GiB. Fix: enlarge that tmpfs (mount -o remount,size=...), set DistributedConfig.shm_dir to a "
            "larger one, or share_frozen=False (one private copy per rank)."
        )


def _check_layouts(every: list[tuple[int, int, list, int]]) -> None:
    """Every rank shares the same frozen tensors (shapes, dtypes, order); local rank 0 holds them for real."""
    from tidal_stream.distributed import DistributedError

    first = every[0][2]
    for rank, (node, local, layout, meta) in enumerate(every):
        if layout != first:
            raise DistributedError(
                f"shared host copy: rank {rank} holds {len(layout)} frozen host tensors, rank 0 {len(first)} "
                "(or shapes / dtypes differ); every rank must hold the same frozen weights. Fix: load the "
                "model identically on every rank (or share_frozen=False)."
            )
        if local == 0 and meta:
            raise DistributedError(
                f"shared host copy: local rank 0 of node {node} (rank {rank}) holds {meta} frozen tensors on "
                "the meta device, but it fills the node's copy. Fix: load the frozen weights on local rank 0 "
                "(the other local ranks may keep them on the meta device)."
            )


class SharedHostCopy:
    """Frozen host tensors of a model placed in one shared mapping per machine.

    Build with :meth:`share_frozen` (collective: every rank of the process group calls it).

    Args:
        entries: ``(holders, tensor)`` of the frozen parameters to share: every ``(module, name)`` that
            holds the tensor (a tied weight has several), and the tensor (on the host, or on the meta
            device on a local rank other than 0).
        ctx: the rank's ``DPContext`` (local rank, barriers).
        shm_dir: tmpfs folder of the backing file.
        token: a name part identical on every rank (made by rank 0).
    """

    def __init__(
        self,
        entries: list[tuple[list[tuple[nn.Module, str]], torch.Tensor]],
        ctx: Any,
        shm_dir: str,
        token: str,
    ):
        self.ctx = ctx
        offsets, total = [], 0
        for _, t in entries:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        total = -(-total // _PAGE) * _PAGE  # whole pages: every page of the mapping lies inside the file
        self.nbytes = total
        self.tensors = len(entries)
        self.offsets = offsets  # byte offset of each entry, ascending
        self.sizes = [t.numel() * t.element_size() for _, t in entries]
        self.released_bytes = 0  # pages given back by settle(): no local rank reads them from the host
        self._pinned: list[torch.Tensor] = []  # page runs this rank registered (settle); unpinned by release
        self.path = os.path.join(shm_dir, f"tidal-{token}-node{ctx.node}")
        if ctx.local_rank == 0:
            _check_room(shm_dir, total)  # a full tmpfs fails here, not later with SIGBUS on a write
            with open(self.path, "wb") as f:
                # sparse: pages are allocated as the copy writes them while the private copies are freed one
                # by one (reserving them all first would need room for both copies at once)
                f.truncate(total)
            buf = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)  # [total] bytes
            with torch.no_grad():
                for (owners, t), off in zip(entries, offsets):
                    view = self._view(buf, off, t)
                    view.copy_(t.detach())
                    _bind(owners, t, view)  # the private copy goes now: the peak is one copy + one tensor
        ctx.barrier("shared host copy: local rank 0 filled it")
        if ctx.local_rank != 0:
            buf = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)  # [total] bytes
            for (owners, t), off in zip(entries, offsets):
                _bind(owners, t, self._view(buf, off, t))
        self._buf: torch.Tensor | None = buf
        ctx.barrier("shared host copy: every local rank mapped it")
        if ctx.local_rank == 0:
            os.unlink(self.path)  # the mappings stay; the name is gone (no leftover on a crash)

    @staticmethod
    def _view(buf: torch.Tensor, off: int, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        return buf[off : off + n].view(t.dtype).view(t.shape)

    @classmethod
    def share_frozen(
        cls, model: nn.Module, ctx: Any, shm_dir: str, token: str, record: Callable[..., None]
    ) -> SharedHostCopy | None:
        """Share the model's frozen parameters that live in host memory; None when there are none.

        Args:
            model: the wrapped model.
            ctx: the rank's ``DPContext``.
            shm_dir: tmpfs folder of the backing file.
            token: a name part identical on every rank.
            record: the decision log's ``record(kind, message, **data)``.
        """
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for mod in model.modules():
            for name, p in mod._parameters.items():
                if p is None or p.requires_grad or p.device.type not in ("cpu", "meta"):
                    continue
                if not p.is_contiguous():
                    continue  # views of the byte buffer are contiguous; keep such a tensor private
                owners.setdefault(id(p), []).append((mod, name))  # a tied weight: every holder
                tensors[id(p)] = p
        entries = [(owners[k], t) for k, t in tensors.items()]
        layout = [(tuple(t.shape), str(t.dtype)) for _, t in entries]
        meta = sum(t.is_meta for _, t in entries)
        every = ctx.all_objects((ctx.node, ctx.local_rank, layout, meta), "shared host copy layout exchange")
        _check_layouts(every)
        if not layout:
            record(
                "shared-host",
                "shared host copy: no frozen weights in host memory on any rank: nothing shared",
            )
            return None
        if not os.path.isdir(shm_dir):
            from tidal_stream.errors import option_error

            raise option_error("distributed.shm_dir", shm_dir, "an existing tmpfs folder such as /dev/shm")
        copy = cls(entries, ctx, shm_dir, token)
        record(
            "shared-host",
            f"shared host copy: {copy.tensors} frozen tensors, {copy.nbytes / 2**20:.1f} MiB, one copy for the "
            f"{ctx.local_world} ranks of node {ctx.node} (counted on local rank 0)"
            + (f"; {meta} placeholders on the meta device filled from it" if meta else ""),
            bytes=copy.nbytes,
            local_world=ctx.local_world,
            meta_placeholders=meta,
        )
        return copy

    def owns(self, t: torch.Tensor) -> bool:
        """``t`` lies in this rank's mapping of the copy (a view :meth:`share_frozen` made)."""
        buf = self._buf
        if buf is None or t.device.type != "cpu":
            return False
        lo, n = buf.data_ptr(), t.numel() * t.element_size()
        return lo <= t.data_ptr() and t.data_ptr() + n <= lo + self.nbytes

    def settle(self, in_use: Iterable[torch.Tensor], pin: bool, record: Callable[..., None]) -> None:
        """Give back the pages no local rank reads from the host, then (``pin``) page-lock the rest.

        Collective over the process group (every rank calls it once, after weight streaming is installed
        and resident weights moved to the device).

        Args:
            in_use: the host tensors this rank still reads (the streamed blocks' host copies, frozen
                weights left on the host); those outside the mapping are ignored.
            pin: page-lock the used runs on this rank (CUDA: the streamed blocks' H2D copies read them).
            record: the decision log's ``record(kind, message, **data)``.
        """
        from tidal_arena import PageLockLimitError, pin_

        buf = self._buf
        assert buf is not None, "settle() after release()"
        base = buf.data_ptr()
        mine = set()
        for t in in_use:
            if self.owns(t):
                i = bisect.bisect_right(self.offsets, t.data_ptr() - base) - 1
                mine.add(i)
        every = self.ctx.all_objects((self.ctx.node, sorted(mine)), "shared host copy: entries in use")
        used_entries = {i for node, idx in every if node == self.ctx.node for i in idx}
        spans = [(self.offsets[i], self.offsets[i] + self.sizes[i]) for i in sorted(used_entries)]
        used, free = page_runs(spans, self.nbytes)
        # every local rank has moved its resident weights off the mapping before any page is removed
        self.ctx.barrier("shared host copy: resident weights left the mapping")
        self.released_bytes = sum(hi - lo for lo, hi in free)
        if self.ctx.local_rank == 0:  # it removes the pages for every mapper; the copy is counted here
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            for k, (lo, hi) in enumerate(free):
                if libc.madvise(base + lo, hi - lo, _MADV_REMOVE) != 0:
                    err = ctypes.get_errno()
                    log.warning("shared host copy: madvise(MADV_REMOVE) failed: %s", os.strerror(err))
                    self.released_bytes = sum(b - a for a, b in free[:k])  # what was really given back
                    break
        kept = sum(hi - lo for lo, hi in used)
        record(
            "shared-host",
            f"shared host copy: {kept / 2**20:.1f} MiB still read from the host by {len(used_entries)} of "
            f"{self.tensors} tensors; {self.released_bytes / 2**20:.1f} MiB of resident weights given back",
            kept_bytes=kept,
            released_bytes=self.released_bytes,
        )
        if not pin:
            return
        try:
            for lo, hi in used:
                self._pinned.append(pin_(buf[lo:hi], view=True))
        except PageLockLimitError as e:
            self._unpin()
            record(
                "shared-host",
                f"shared host copy: could not page-lock it ({e}); streamed blocks copy from pageable memory "
                "(synchronous, slower H2D). Fix: raise ulimit -l or free page-locked memory.",
            )
            log.warning("shared host copy stays pageable: %s", e)
            return
        record(
            "shared-host",
            f"shared host copy: {kept / 2**20:.1f} MiB page-locked on this rank in {len(used)} runs "
            "(asynchronous H2D from the mapping)",
            pinned_bytes=kept,
        )

    def _unpin(self) -> None:
        from tidal_arena import unpin_

        while self._pinned:
            unpin_(self._pinned.pop(), view=True)

    def release(self) -> None:
        """Unregister the page-locked runs and drop this object's reference to the mapping (``unwrap()``);
        tensors still viewing it keep it."""
        self._unpin()
        self._buf = None

    def smaps(self) -> dict[str, int]:
        """This process's ``Rss`` and ``Pss`` of the shared mapping, bytes (from ``/proc/self/smaps``)."""
        out = {"rss": 0, "pss": 0}
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    inside = self.path in line
                elif inside and head and head[0] in ("Rss:", "Pss:"):
                    out[head[0][:-1].lower()] += int(head[1]) * 1024
        return out

    def report(self) -> dict[str, Any]:
        """Bytes of the copy, how many this rank counts (once per machine), and the mapping's Rss/Pss."""
        return {
            "path": self.path,
            "bytes": self.nbytes,
            "tensors": self.tensors,
            "counted_bytes": self.nbytes - self.released_bytes if self.ctx.local_rank == 0 else 0,
            "released_bytes": self.released_bytes,
            "pinned_bytes": sum(t.numel() for t in self._pinned),
            "local_world": self.ctx.local_world,
            **{f"mapped_{k}": v for k, v in self.smaps().items()},
        }
