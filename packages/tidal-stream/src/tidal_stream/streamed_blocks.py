"""``StreamedBlocks``: bounded-residency weight streaming over an ordered list of blocks.

Every parameter and buffer of every block lives in (pinned) host memory; at most ``prefetch_ahead + 1``
blocks hold device copies at a time. Module forward pre/post hooks — never a patched ``forward`` —
refill block ``i`` (if the prefetch has not already) and start the H2D copy of the next ``k`` streamed
blocks after it on the H2D stream, then release block ``i`` once its forward is queued. In training, a
gradient hook on each block's outputs refills the block again before its backward runs and prefetches
the next ``k`` streamed blocks before it (reverse order); blocks whose backward is finished are released,
the rest at the end of backward. Blocks kept resident (``keep_resident``) are skipped when looking ahead:
the copy of the streamed block after them runs while they compute.

[Note: turn holds] A training step turns twice: the backward needs first the blocks the forward ran last,
and the next forward needs first the blocks the backward ran last. With ``hold_turns`` the window keeps
them over each turn instead of releasing and refilling them — the last streamed blocks of a forward that
builds a graph stay for its backward; after the backward, the first streamed blocks without trainable
tensors (whose host copies no optimizer rewrites) stay for the next forward. Both sets are one window
(:func:`~tidal_stream._stream_slots.window_of`), so the bound on resident blocks holds; a held block that
the next forward does not start with (a forward without its backward, a changed set of streamed blocks)
is released when that forward begins. A forward without autograd (evaluation, a decode step) turns
straight into the next forward: its last blocks prefetch that head, so a loop of such forwards never
waits for its first block's copy.

[Note: storage handling] As FSDP2 reshards: the ``Parameter`` objects (and buffer tensors) stay put;
releasing resizes their device storage to 0 bytes, refilling resizes it back and copies the host copy in
place (``t.untyped_storage().resize_(n)`` then ``copy_``). Tensors autograd saved in forward share that
storage, so they are valid again once the block is refilled for backward. Copies go through ``.data`` so
autograd's version counters are not bumped.

[Note: allocation stream] Device storage is (re)allocated on the compute stream, then the H2D stream
waits for an event recorded right after the allocation before writing into it: the caching allocator
only orders reuse on the allocating stream, and the bytes just handed out may still be read by kernels
queued on the compute stream for an earlier block.

Assumptions: the blocks run in list order, each at most once per forward (a decoder layer stack); a
block called out of order is fetched on demand (counted as a stall). ``device="cpu"`` runs the same
logic with synchronous copies and stand-in streams, so CPU CI checks it bit-exactly.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from tidal_plan import streamed_ahead
from tidal_stream._block_adoption import BlockAdoption
from tidal_stream._empty_guard import drop, lift, unguard
from tidal_stream._host_buffers import HostBuffers
from tidal_stream._stream_slots import ResidencyEvent, _Block, _tensors_of, window_of
from tidal_stream.errors import SlotBudgetError, StreamingError
from tidal_stream.streams import NullStream, device_streams, record_event, stream_context

__all__ = ["ResidencyEvent", "SlotBudgetError", "StreamedBlocks", "StreamingError"]

logger = logging.getLogger(__name__)

_HISTORY_CAP = 20_000  # residency events kept in ``history`` (the latest; the observer sees all)


class StreamedBlocks:
    """Stream the weights of an ordered block stack with at most ``prefetch_ahead + 1`` blocks resident.

    Args:
        blocks: The blocks in execution order (e.g. ``model.model.layers``). Their parameters and buffers
            move to host memory; the ``Parameter`` objects stay the same (optimizers keep working).
        device: Where the blocks compute (``"cuda"``, ``"cuda:N"``, or ``"cpu"`` as a stand-in).
        prefetch_ahead: Streamed blocks fetched ahead of the running one, forward and backward (``k >= 0``);
            blocks kept resident between are skipped.
        slot_bytes: Optional per-block byte budget; a larger block raises :class:`SlotBudgetError`.
        arena: Optional ``tidal_arena.PinnedArena`` for the host copies.
        pin: Page-lock host copies when no arena is given (CUDA only).
        streams: Optional ``DeviceStreams``; defaults to the shared ones of ``device``.
        observer: Optional callback receiving every :class:`ResidencyEvent`.
        max_inflight_bytes: Optional cap on the device bytes of the streamed blocks fetched ahead of the
            running one; prefetching pauses at the cap. Must fit the largest block.
        keep_resident: Blocks held on the device permanently (their host copies are kept, so
            :meth:`set_resident` can stream them later); they do not count against the window.
        before_fetch: Optional ``fn(block_index, tensors)`` called before a block's host copies are
            read for a refill — e.g. a host optimizer blocks there until its update of those tensors
            has been written to their host copies (:meth:`host_tensor`).
        stream_trainable: Stream parameters that require grad too (full fine-tuning). False leaves them
            where they are, untouched (e.g. LoRA adapters next to a streamed frozen base).
        adopt_host: Optional ``fn(tensor) -> bool``: a frozen host tensor for which it is True is used in
            place as its own host copy (no private copy), e.g. a view of the machine-wide shared mapping
            of :mod:`tidal_stream.shared_host`; it must stay valid and unchanged while streamed (and be
            page-locked on CUDA, e.g. ``cudaHostRegister``, or the H2D copies from it are synchronous).
        hold_turns: Keep the window's blocks over the turns of a training step, and prefetch the next
            forward's first frozen blocks at the end of a forward without autograd (see [Note: turn holds]).

    Raises:
        StreamingError: a parameter is shared by two blocks, or a block tensor is not dense.
        SlotBudgetError: a block exceeds ``slot_bytes``.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        *,
        prefetch_ahead: int = 1,
        slot_bytes: int | None = None,
        arena: Any | None = None,
        pin: bool = True,
        streams: Any | None = None,
        observer: Callable[[ResidencyEvent], None] | None = None,
        max_inflight_bytes: int | None = None,
        keep_resident: Sequence[int] = (),
        before_fetch: Callable[[int, list[torch.Tensor]], None] | None = None,
        stream_trainable: bool = True,
        adopt_host: Callable[[torch.Tensor], bool] | None = None,
        hold_turns: bool = False,
    ) -> None:
        if not isinstance(prefetch_ahead, int) or isinstance(prefetch_ahead, bool) or prefetch_ahead < 0:
            raise StreamingError(
                f"StreamedBlocks: prefetch_ahead={prefetch_ahead!r} is invalid; accepted: an int >= 0. "
                "Fix: pass 1 (default) or 2 to overlap the next blocks' copies with compute."
            )
        for opt, val in (("slot_bytes", slot_bytes), ("max_inflight_bytes", max_inflight_bytes)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                raise StreamingError(
                    f"StreamedBlocks: {opt}={val!r} is invalid; accepted: None or an int > 0. "
                    "Fix: pass None for no budget, or at least the largest block's bytes."
                )
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise StreamingError(
                f"StreamedBlocks: blocks={type(blocks).__name__} of {len(blocks)} items is invalid; "
                "accepted: a non-empty sequence of nn.Module. Fix: pass the layer stack, e.g. model.layers."
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch_ahead = prefetch_ahead
        self.slot_bytes = slot_bytes
        self.streams = streams if streams is not None else device_streams(self.device)
        self.host = HostBuffers(self.device, arena, pin)
        self.observer = observer
        self.before_fetch = before_fetch
        self.history: collections.deque[ResidencyEvent] = collections.deque(maxlen=_HISTORY_CAP)
        self._seq = 0
        self._hooks: list[Any] = []
        self._bwd_task = -1  # graph task of the backward pass being served
        self._h2d_bytes = 0
        self._source_bytes = 0  # refilled from set_source tensors (not over the host link)
        self._h2d_ms_cpu = 0.0
        self._stall_ms_cpu = 0.0
        self._fetches = 0
        self._demand_fetches = 0
        self._timings: list[tuple[Any, Any]] = []  # (start, end) CUDA timing events of H2D copies
        self._stalls: list[tuple[Any, Any]] = []  # timing events around compute-stream waits
        self._h2d_ms_done = 0.0
        self._stall_ms_done = 0.0
        self._peak_blocks = 0
        self._peak_bytes = 0
        self.max_inflight_bytes = max_inflight_bytes
        self.stream_trainable = bool(stream_trainable)
        self._pinned: set[int] = set()
        self.adopt_host = adopt_host
        self.hold_turns = bool(hold_turns)
        self._turn_holds = 0  # blocks kept over a turn (each one refill saved when it is used)
        adoption = BlockAdoption(self.device, self.host, slot_bytes, self.stream_trainable, adopt_host)
        self._blocks = adoption.adopt(blocks)
        self._adopted_bytes = adoption.adopted_bytes  # host bytes used in place (adopt_host), not copied
        largest = max(b.nbytes for b in self._blocks)
        if max_inflight_bytes is not None and max_inflight_bytes < largest:
            raise SlotBudgetError(
                f"StreamedBlocks: max_inflight_bytes={max_inflight_bytes} cannot hold the largest block "
                f"({largest} bytes); accepted: >= {largest}. Fix: raise max_inflight_bytes to at least "
                f"{largest} (x (prefetch_ahead + 1) to overlap copies with compute)."
            )
        for i in keep_resident:
            self.set_resident(i, True)
        for b in self._blocks:
            self._hooks.append(b.module.register_forward_pre_hook(self._make_pre_hook(b.index)))
            self._hooks.append(b.module.register_forward_hook(self._make_post_hook(b.index)))

    # ----------------------------------------------------------------------------------- residency
    def _record(self, kind: Literal["fetch", "release"], block: int, phase: Any) -> None:
        resident = tuple(b.index for b in self._blocks if b.resident)
        nbytes = sum(self._blocks[j].nbytes for j in resident)
        # peaks count the streaming window only: blocks kept resident are there by design
        self._peak_blocks = max(self._peak_blocks, self._n_resident())
        self._peak_bytes = max(self._peak_bytes, self._streamed_resident_bytes())
        ev = ResidencyEvent(self._seq, kind, block, phase, resident, nbytes)
        self._seq += 1
        self.history.append(ev)
        if self.observer is not None:
            self.observer(ev)

    def _n_resident(self) -> int:
        return sum(1 for b in self._blocks if b.resident and b.index not in self._pinned)

    def _streamed_resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._blocks if b.resident and b.index not in self._pinned)

    def _fetch(self, i: int, phase: Any, compute: Any) -> None:
        """Refill block ``i``'s device storage from its host copy on the H2D stream."""
        b = self._blocks[i]
        if b.resident:
            return
        h2d = self.streams.h2d
        cuda = not isinstance(h2d, NullStream)
        if self.before_fetch is not None:
            self.before_fetch(i, [s.tensor for s in b.slots])
        with torch.profiler.record_function(f"tidal::stream.fetch[{i}]"), torch.no_grad():
            with stream_context(compute):
                for s in b.slots:
                    s.tensor.untyped_storage().resize_(s.nbytes)
                    lift(s.tensor)  # filled: plain class, so its reads skip the empty-storage check
                # why: the bytes just allocated may still be read by kernels queued on the compute stream
                alloc_done = record_event(compute)
            t0 = time.perf_counter()
            timed = cuda and not b.sourced  # the timings measure the host link only
            with stream_context(h2d):
                alloc_done.wait(h2d)  # why: see above — write only after those kernels finished
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(h2d)
                for s in b.slots:
                    # a source on another GPU: torch fences the copy between this stream's earlier and later work
                    s.tensor.data.copy_(s.host if s.source is None else s.source, non_blocking=cuda)
                if timed:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(h2d)
                    self._timings.append((start, end))
                # why: consumers (compute stream, release) must not touch the storage before the copy lands
                b.ready = record_event(h2d)
            if not cuda and not b.sourced:
                self._h2d_ms_cpu += (time.perf_counter() - t0) * 1e3
        b.resident = True
        b.fetches += 1
        self._source_bytes += b.nbytes if b.sourced else 0
        self._h2d_bytes += 0 if b.sourced else b.nbytes
        self._fetches += 1
        self._record("fetch", i, phase)
        self._drain_timings()

    def _release(self, i: int, phase: Any) -> None:
        b = self._blocks[i]
        if not b.resident or i in self._pinned:
            return
        with torch.profiler.record_function(f"tidal::stream.release[{i}]"):
            if b.ready is not None:
                # why: a prefetched-but-unused block's copy may still be writing into the storage we free
                b.ready.wait(b.compute if b.compute is not None else self.streams.compute())
            for s in b.slots:
                s.tensor.untyped_storage().resize_(0)
                drop(s.tensor)  # empty: reads raise a clear error again
        b.resident = False
        b.ready = None
        self._record("release", i, phase)

    def _make_ready(self, i: int, phase: Any) -> None:
        """Block ``i`` is about to compute: refill it if needed and make the compute stream wait for it."""
        b = self._blocks[i]
        compute = self.streams.compute()
        b.compute = compute
        if not b.resident:
            self._demand_fetches += 1
            t0 = time.perf_counter()
            self._fetch(i, phase, compute)
            if isinstance(compute, NullStream):
                self._stall_ms_cpu += (time.perf_counter() - t0) * 1e3
        if b.ready is not None:
            if isinstance(compute, NullStream):
                b.ready.wait(compute)
            else:
                t0e = torch.cuda.Event(enable_timing=True)
                t0e.record(compute)
                b.ready.wait(compute)  # why: the block's kernels read the weights the H2D copy writes
                t1e = torch.cuda.Event(enable_timing=True)
                t1e.record(compute)
                self._stalls.append((t0e, t1e))
            b.ready = None

    def _prefetch(self, order: Sequence[int], running: int) -> None:
        """Fetch the blocks of ``order`` ahead of block ``running`` while the window has room."""
        compute = self._blocks[running].compute
        for j in order:
            if j in self._pinned or self._blocks[j].resident:
                continue
            if self._n_resident() >= self.prefetch_ahead + 1:
                return
            cap = self.max_inflight_bytes
            ahead = self._streamed_resident_bytes() - (
                0 if running in self._pinned else self._blocks[running].nbytes
            )
            if cap is not None and ahead + self._blocks[j].nbytes > cap:
                return
            self._blocks[j].compute = compute
            self._fetch(j, "prefetch", compute)

    def _ahead(self, i: int, step: int) -> list[int]:
        """The next ``prefetch_ahead`` streamed blocks after block ``i`` in the direction ``step`` (+1 forward,
        -1 backward). Blocks kept resident between are skipped: their compute hides the copies."""
        return streamed_ahead(
            [j not in self._pinned for j in range(len(self._blocks))], i, self.prefetch_ahead, step
        )

    def _forward_ahead(self, i: int) -> list[int]:
        """What a forward prefetches at block ``i``: the next streamed blocks, and in a forward without
        autograd, once they run out, the head the next forward starts with (see [Note: turn holds])."""
        ahead = self._ahead(i, 1)
        if self.hold_turns and not torch.is_grad_enabled() and len(ahead) < self.prefetch_ahead:
            head = sorted(self._head_holds() - {i, *ahead})
            ahead += head[: self.prefetch_ahead - len(ahead)]
        return ahead

    def _streamed_order(self, reverse: bool = False) -> list[_Block]:
        """The streamed (not kept resident) blocks in forward order, or backward order."""
        order = [b for b in self._blocks if b.index not in self._pinned]
        return order[::-1] if reverse else order

    def _window(self, order: list[_Block]) -> frozenset[int]:
        return window_of(order, self.prefetch_ahead, self.max_inflight_bytes)

    def _head_holds(self) -> frozenset[int]:
        """The blocks kept from a backward for the next forward (see [Note: turn holds])."""
        if not self.hold_turns:
            return frozenset()
        head = self._window(self._streamed_order())
        return frozenset(i for i in head if not any(s.trainable for s in self._blocks[i].slots))

    def _release_stale_holds(self, i: int) -> None:
        """A forward reaches block ``i``: release the blocks after it it does not start with (held for a
        backward that never came, or for a start the streamed set no longer has)."""
        wanted = self._window([b for b in self._streamed_order() if b.index >= i])
        for b in self._blocks[i:]:
            if b.resident and b.index not in wanted:
                self._release(b.index, "forward")

    # ----------------------------------------------------------------------------------- hooks
    def _make_pre_hook(self, i: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: Any) -> None:
            in_bwd = torch._C._current_graph_task_id() != -1
            if self.hold_turns and not in_bwd:
                self._release_stale_holds(i)
            self._make_ready(i, "backward" if in_bwd else "forward")
            if not in_bwd:
                self._prefetch(self._forward_ahead(i), i)

        return pre_hook

    def _make_post_hook(self, i: int) -> Callable[..., None]:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # a recompute inside backward: the backward hooks release this block
            outs = _tensors_of(output) if torch.is_grad_enabled() else []
            if outs:
                # the handle lives as long as the graph does; no need to keep it
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda _g: self._pre_backward(i), mode="any"
                )
                if self.hold_turns and i in self._window(self._streamed_order(reverse=True)):
                    self._turn_holds += 1
                    return  # the backward starts with this block: it stays (see [Note: turn holds])
            self._release(i, "forward")

        return post_hook

    def _pre_backward(self, i: int) -> None:
        """Block ``i``'s output gradients exist: its backward runs next, later blocks' backward is done."""
        if not self._hooks:
            return  # removed while a graph built under the hooks was still alive
        task = torch._C._current_graph_task_id()
        if task != self._bwd_task:
            self._bwd_task = task
            # release whatever is still resident once this backward pass has run
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        head = self._head_holds()
        for b in self._blocks[i + 1 :]:
            if b.index not in head:  # the head waits for the next forward (see [Note: turn holds])
                self._release(b.index, "backward")
        self._make_ready(i, "backward")
        self._prefetch(self._ahead(i, -1), i)

    def _end_backward(self) -> None:
        self._bwd_task = -1
        head = self._head_holds()
        for b in self._blocks:
            if b.index in head and b.resident and b.index not in self._pinned:
                self._turn_holds += 1
                continue  # the next forward starts with it (see [Note: turn holds])
            self._release(b.index, "backward")

    # ----------------------------------------------------------------------------------- public
    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def h2d_bytes(self) -> int:
        """Bytes copied host → device so far (cheap; :meth:`stats` also syncs the timings)."""
        return self._h2d_bytes

    def block_bytes(self) -> list[int]:
        """Device bytes of each block's parameters and buffers, in block order."""
        return [b.nbytes for b in self._blocks]

    def resident(self) -> tuple[int, ...]:
        """Indices of the blocks whose device copy is filled now."""
        return tuple(b.index for b in self._blocks if b.resident)

    def set_resident(self, i: int, keep: bool) -> None:
        """Hold block ``i`` on the device permanently (``keep=True``) or stream it again (call between
        steps). Un-keeping writes its trainable parameters back to the host copy first."""
        if not isinstance(i, int) or not 0 <= i < len(self._blocks):
            raise StreamingError(
                f"StreamedBlocks.set_resident: block index {i!r} is invalid; accepted: 0..{len(self) - 1}."
            )
        compute = self.streams.compute()
        if keep:
            self._fetch(i, "gather", compute)
            self._make_ready(i, "gather")
            self._pinned.add(i)
            return
        if i in self._pinned:
            self._writeback([self._blocks[i]], compute)
            self._pinned.discard(i)
            self._release(i, "gather")

    def host_copies(self, i: int) -> list[torch.Tensor]:
        """Host copies of block ``i``'s streamed tensors, in the order :meth:`set_source` takes them."""
        return [s.host for s in self._blocks[i].slots]

    def set_source(self, i: int, sources: Sequence[torch.Tensor] | None) -> None:
        """Refill frozen block ``i`` from ``sources`` (like :meth:`host_copies`, e.g. views of a peer GPU's
        copy; kept valid and unchanged while set) instead of its host copies; None: the host copies again."""
        b = self._blocks[i]
        src = list(sources) if sources is not None else [None] * len(b.slots)
        if sources is not None and (
            len(src) != len(b.slots)
            or any(s.trainable for s in b.slots)
            or any(t.shape != s.host.shape or t.dtype != s.host.dtype for t, s in zip(src, b.slots))
        ):
            raise StreamingError(
                f"StreamedBlocks.set_source: block {i} takes {len(b.slots)} tensors shaped as host_copies({i}) "
                f"and must have no trainable tensors; got {len(src)}. Fix: pass one tensor per host copy."
            )
        for s, t in zip(b.slots, src):
            s.source = t
        b.sourced = sources is not None

    def kept_resident(self) -> tuple[int, ...]:
        """Blocks held on the device permanently."""
        return tuple(sorted(self._pinned))

    def _writeback(self, blocks: Sequence[_Block], compute: Any) -> None:
        with torch.no_grad(), stream_context(self.streams.d2h):
            # why: the D2H copies read values the compute stream has just written
            record_event(compute).wait(self.streams.d2h)
            for b in blocks:
                for s in b.slots:
                    if s.trainable:
                        s.host.copy_(s.tensor.data, non_blocking=False)

    def host_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host master copy of a streamed parameter or buffer (update it to change the weights)."""
        for b in self._blocks:
            for s in b.slots:
                if s.tensor is tensor:
                    return s.host
        raise StreamingError(
            "StreamedBlocks.host_tensor: the tensor given is not a parameter or buffer of the streamed "
            "blocks; accepted: one of blocks[i].parameters()/buffers(). Fix: pass that very tensor object."
        )

    def block_of(self, tensor: torch.Tensor) -> int | None:
        """Position (in this object's block list) of the block streaming ``tensor``, or None."""
        for b in self._blocks:
            if any(s.tensor is tensor for s in b.slots):
                return b.index
        return None

    @contextlib.contextmanager
    def gathered(self, writeback: bool = True) -> Iterator[None]:
        """Fill every block on the device for the duration (e.g. a plain optimizer step).

        Args:
            writeback: Copy trainable parameters back to their host copies on exit, so updates persist.
        """
        compute = self.streams.compute()
        for b in self._blocks:
            self._fetch(b.index, "gather", compute)
            self._make_ready(b.index, "gather")
        try:
            yield  # every block filled, so plain classes: torch's optimizers keep their foreach path
        finally:
            if writeback:
                self._writeback(self._blocks, compute)
            for b in self._blocks:
                self._release(b.index, "gather")

    def stats(self) -> dict[str, Any]:
        """Counters: ``h2d_bytes`` (from host copies), ``source_bytes`` (from :meth:`set_source` tensors),
        ``h2d_ms`` (host copy time on the H2D stream), ``h2d_gbps``, ``stall_ms``
        (time compute waited for weights), ``fetches``, ``demand_fetches`` (not prefetched in time),
        ``resident_peak_blocks`` and ``resident_peak_bytes`` (of the streaming window, blocks kept
        resident excluded), ``resident_now``, ``kept_resident``, ``block_bytes``, ``degraded``,
        ``adopted_host_bytes`` (host copies used in place through ``adopt_host``, not copied),
        ``turn_holds`` (blocks kept over a turn, [Note: turn holds]), ``block_fetches`` (refills per block).

        On CUDA this synchronizes the recorded timing events.
        """
        self._drain_timings(block=True)
        h2d_ms = self._h2d_ms_cpu + self._h2d_ms_done
        return {
            "h2d_bytes": self._h2d_bytes,
            "source_bytes": self._source_bytes,
            "h2d_ms": h2d_ms,
            "h2d_gbps": (self._h2d_bytes / (h2d_ms * 1e6)) if h2d_ms > 0 else 0.0,
            "stall_ms": self._stall_ms_cpu + self._stall_ms_done,
            "fetches": self._fetches,
            "demand_fetches": self._demand_fetches,
            "resident_peak_blocks": self._peak_blocks,
            "resident_peak_bytes": self._peak_bytes,
            "resident_now": self.resident(),
            "kept_resident": self.kept_resident(),
            "block_bytes": self.block_bytes(),
            "prefetch_ahead": self.prefetch_ahead,
            "degraded": list(self.host.degraded),
            "adopted_host_bytes": self._adopted_bytes,
            "turn_holds": self._turn_holds,
            "block_fetches": [b.fetches for b in self._blocks],
        }

    def reset_stats(self) -> None:
        """Zero the counters and the history (e.g. after warm-up)."""
        self._drain_timings(block=True)
        self._h2d_bytes = self._source_bytes = self._fetches = self._demand_fetches = self._turn_holds = 0
        for b in self._blocks:
            b.fetches = 0
        self._h2d_ms_cpu = self._stall_ms_cpu = self._h2d_ms_done = self._stall_ms_done = 0.0
        self._peak_blocks = self._n_resident()
        self._peak_bytes = self._streamed_resident_bytes()
        self.history.clear()

    def _drain_timings(self, block: bool = False) -> None:
        for lst, attr in ((self._timings, "_h2d_ms_done"), (self._stalls, "_stall_ms_done")):
            keep = []
            for start, end in lst:
                if block:
                    end.synchronize()
                if end.query():
                    setattr(self, attr, getattr(self, attr) + start.elapsed_time(end))
                else:
                    keep.append((start, end))
            lst[:] = keep

    def remove(self) -> None:
        """Remove the hooks and leave every block resident on the device (host copies dropped)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pinned.clear()
        compute = self.streams.compute()
        for b in self._blocks:
            self._fetch(b.index, "gather", compute)
            self._make_ready(b.index, "gather")
        # why: host buffers may be reused only after the last H2D copy out of them has finished
        self.host.free_all(after=record_event(self.streams.h2d))
        for b in self._blocks:
            for s in b.slots:
                unguard(s.tensor)
            b.slots.clear()
