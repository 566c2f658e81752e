"""The page traffic of :class:`~tidal_kv.PagedKVCache`: gathers of host pages into device slots (ahead of use,
on the H2D stream), flushes of filled pages to the host (D2H stream), the events that order them, and
:meth:`~PageTransfers.gather`, the slow read of a layer's pages for inspection.

A mixin: the state it works on (slots, streams, host chunks, counters) is the cache's, set up by
``PagedKVCache._materialize``; this module keeps the copy and event protocol in one place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tidal_arena import RowCopy, copy_rows
from tidal_kv.slots import GatherPlan, Slot, pick_slot
from tidal_kv.storage import decode_pages
from tidal_kv.streams import on, profiled, ranged, record, synchronize, wait

logger = logging.getLogger(__name__)


class PageTransfers:
    """Gathers, flushes and prefetches of :class:`~tidal_kv.PagedKVCache`'s offloaded layers (a mixin)."""

    # ------------------------------------------------------------------ streams and events

    def _compute(self) -> Any:
        """The device's current stream (None on the CPU)."""
        return self._current_stream() if self._cuda else None

    def _release_current(self, compute: Any) -> None:
        """Hand back the slot the previous update returned: its layer's attention is queued by now."""
        cur = self._current
        if cur is not None:
            # why: a refill of this slot must wait until the compute stream finished reading it
            cur.free_after = cur.free_ev = record(compute, cur.free_ev)
            self._current = None

    def _sync_copies(self) -> None:
        """Block until every queued page copy finished (before buffers are reused or dropped)."""
        # why: in-flight copies still read or write the pages and slots
        synchronize(getattr(self, "_h2d", None), getattr(self, "_d2h", None))
        if getattr(self, "_inline_used", False):
            torch.cuda.synchronize(self._device)  # why: gathers were also issued on the compute stream

    def _set_inline(self, inline: bool) -> None:
        """Issue gathers on the compute stream (True) or the side stream (False) from now on."""
        if inline == self._inline:
            return
        if not inline:
            # why: updates on the compute stream recorded no slot releases; a side-stream gather into any
            # slot must wait until the compute stream finished everything queued so far
            released = record(self._compute())
            for slot in self._slots:
                slot.free_after = released
        self._inline = inline
        self.stats.gather_stream_switches += 1
        logger.debug("page gathers now on the %s stream", "compute" if inline else "side")

    # ------------------------------------------------------------------ inspection

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh contiguous copy of ``layer``'s K/V (slow path for inspection; not used while decoding).

        Args:
            layer: Layer index.

        Returns:
            ``(keys, values)``, each ``[B, H, T, D]`` on the cache's device, or empty ``[0]`` tensors if nothing
            is cached yet.
        """
        self._check_layer(layer)
        self.stats.inspections += 1
        n = self._lengths[layer]
        if self._shape is None or n == 0:
            return torch.empty(0), torch.empty(0)
        if layer not in self._offloaded_set:
            k, v = self._res_at[layer].upto(n)
            return k.clone(), v.clone()
        self._sync_copies()
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()  # why: the tail and pages must be settled
        b, h, d = self._shape
        p, cp = self.config.page_tokens, self._chunk_pages
        full = n // p
        out = torch.empty(2, b, h, n, d, dtype=self._dtype, device=self._device)  # [2, B, H, T, D]
        for page in range(full):
            chunk, i = divmod(page, cp)
            src = self._host[layer][chunk].tokens(i * p, (i + 1) * p)
            kv = src.data.to(self._device)  # [2, B, H, P, D]
            if src.scale is not None:
                kv = decode_pages(kv, src.scale.to(self._device), self._storage, self._dtype)
            out[:, :, :, page * p : (page + 1) * p].copy_(kv)
        out[:, :, :, full * p :].copy_(self._tails[layer].at(0, n - full * p))
        return out[0], out[1]

    # ------------------------------------------------------------------ gathers and flushes

    @ranged("tidal::kv_gather")
    def _gather(self, layer: int, slot: Slot, pages: int) -> int:
        """Queue the H2D copy of ``layer``'s pages ``[slot.pages, pages)`` into ``slot``; returns pages copied."""
        first = slot.pages
        if pages <= first:
            return 0
        if self._inline:
            return self._gather_inline(layer, slot, first, pages)
        h2d = self._h2d
        wait(h2d, slot.free_after)  # why: the compute stream may still read the previous owner
        flushed = self._flush_done.pop(layer, None)
        if flushed is not None:
            # why: these host pages may still be in flight D2H; once waited for, stream order covers every
            # later gather of this layer, so the event is dropped (one wait per flush, not per step)
            wait(h2d, flushed)
        # the decode step's case: the same pages as the last gather of this layer into this slot
        plan = slot.plans.get(layer)
        if plan is None or plan.key != (first, pages):
            plan = self._plan(layer, slot, first, pages)
        plan.issue(h2d)
        # why: the compute stream waits on this before reading the slot
        slot.ready = slot.ready_ev = record(h2d, slot.ready_ev)
        return self._gathered(slot, plan)

    def _gather_inline(self, layer: int, slot: Slot, first: int, pages: int) -> int:
        """:meth:`_gather` on the compute stream: stream order makes every event of a side gather unneeded
        (see [Note: gathers on the compute stream] in :mod:`tidal_kv.policy`)."""
        compute = self._compute()
        if slot.ready is not None:
            wait(compute, slot.ready)  # why: a side-stream gather into this slot may still be in flight
            slot.ready = None
        flushed = self._flush_done.pop(layer, None)
        if flushed is not None:
            wait(compute, flushed)  # why: these host pages may still be in flight D2H
        plan = self._plan(layer, slot, first, pages)
        plan.issue(compute, self._h2d)  # why: captured on the side stream, launched in compute order
        self._inline_used = self._cuda
        self.stats.inline_gathers += 1
        return self._gathered(slot, plan)

    def _plan(self, layer: int, slot: Slot, first: int, pages: int) -> GatherPlan:
        """The (cached) plan of a gather of ``layer``'s pages ``[first, pages)`` into ``slot``."""
        tail = self._tails[layer].buf  # [2, B, H, P, D]
        return slot.gather_plan(layer, first, pages, self._host[layer], self._chunk_layout, tail)

    def _finish(self, slot: Slot, compute: Any, page: int | None = None, tail: Any = None) -> None:
        """Dequantize ``slot``'s staged pages on the compute stream, after their copies landed and before
        attention reads them (see [Note: dequantization off the link] in :mod:`tidal_kv.slots`); with ``page``,
        also copy the layer's partial page ``tail`` behind them, as a decode step does.

        A decode step's one gather of the same pages as the step before replays both as one graph, launched
        where the partial page's own copy would have been.
        """
        staged = slot.staged
        last = staged[-1]
        if page is not None and len(staged) == 1 and last.key[1] == page and last.tail_copy is not None:
            # why: captured on the side stream, launched in compute order
            last.finish.issue(compute, self._h2d)
        else:
            for plan in staged:
                plan.decode_now()
            if page is not None:
                slot.copy_page(page, self._page_tokens, tail)
        staged.clear()

    def _gathered(self, slot: Slot, plan: GatherPlan) -> int:
        """Note ``plan``'s gather into ``slot`` (its pages ``[first, pages)``, and for quantized pages the
        dequantization the layer's update owes, see `_finish`); returns the pages copied."""
        first, pages = plan.key
        if plan.finish is not None:
            slot.staged.append(plan)
        self.stats.h2d_bytes += (pages - first) * self._page_bytes
        slot.pages = pages
        self.stats.pages_gathered += pages - first
        return pages - first

    def _measure_link(self) -> None:
        """Time one host chunk's copy to the device for ``gather_stream="auto"`` (once, at allocation)."""
        src = self._host[self._offloaded[0]][0].data
        dst = self._d2h_stage.data  # [2, B, H, C·P, ·]: the same layout as a host chunk
        copy = RowCopy(dst, src, 3)
        copy(self._h2d)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._h2d)  # why: times the copies below on the stream they run on
        copy(self._h2d)
        copy(self._h2d)
        end.record(self._h2d)
        end.synchronize()  # why: elapsed_time needs both events complete
        self._policy.set_link(2 * src.numel() * src.element_size(), start.elapsed_time(end) / 1e3)

    def _flush(self, layer: int, slot: Slot, first: int, last: int) -> None:
        """Copy the filled pages ``[first, last)`` of ``layer`` from ``slot`` to its host pages (D2H stream)."""
        with profiled("tidal::kv_flush"):
            self._ensure_host_pages(layer, last)
            p, cp = self.config.page_tokens, self._chunk_pages
            compute, stage = self._compute(), self._d2h_stage
            page = first
            while page < last:
                chunk, i0 = divmod(page, cp)
                m = min(cp - i0, last - page)
                wait(compute, self._d2h_free)  # why: the previous D2H copy may still read the staging chunk
                pages_kv = slot.kv[:, :, :, page * p : (page + m) * p]  # [2, B, H, m·P, D]
                staged = stage.packed(m * p)
                staged.store(pages_kv)
                # why: the D2H copy must not read the staging chunk before it is filled
                filled = record(compute)
                dst = self._host[layer][chunk].tokens(i0 * p, (i0 + m) * p)
                with on(self._d2h):  # why: the page drains while the compute stream carries on
                    wait(self._d2h, filled)  # why: see `filled`
                    copy_rows(dst.data, staged.data, 3, self._d2h)
                    if staged.scale is not None:
                        copy_rows(dst.scale, staged.scale, 3, self._d2h)
                    # why: the staging chunk is reusable, and these host pages readable, once this copy finished
                    self._d2h_free = record(self._d2h)
                self._flush_done[layer] = self._d2h_free
                self.stats.d2h_bytes += m * self._page_bytes
                self.stats.pages_flushed += m
                page += m

    def _prefetch_ahead(self, layer: int) -> None:
        """Queue the gathers of the next offloaded layers after ``layer`` that are not pending yet (see
        :func:`~tidal_kv.slots.prefetch_order`), each into a free slot, ahead of its update."""
        pending = self._pending
        for nxt in self._ahead[layer]:
            if nxt not in pending:
                slot = pick_slot(self._slots, pending, self._current, nxt, self.stats)
                slot.prefetched_pages = self._gather(nxt, slot, self._lengths[nxt] // self._page_tokens)
                pending[nxt] = slot
