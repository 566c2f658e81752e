"""The page traffic of :class:`~tidal_kv.PagedKVCache`: gathers of host pages into device slots (ahead of use,
on the H2D stream), flushes of filled pages to the host (D2H stream), and the events that order them.

A mixin: the state it works on (slots, streams, host chunks, counters) is the cache's, set up by
``PagedKVCache._materialize``; this module keeps the copy and event protocol in one place.
"""

from __future__ import annotations

from typing import Any

from tidal_arena import copy_rows
from tidal_kv.slots import Slot, pick_slot
from tidal_kv.streams import on, profiled, ranged, record, synchronize, wait


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

    # ------------------------------------------------------------------ gathers and flushes

    @ranged("tidal::kv_gather")
    def _gather(self, layer: int, slot: Slot, pages: int) -> int:
        """Queue the H2D copy of ``layer``'s pages ``[slot.pages, pages)`` into ``slot``; returns pages copied."""
        first = slot.pages
        if pages <= first:
            return 0
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
            plan = slot.gather_plan(
                layer, first, pages, self._host[layer], self._chunk_layout, self._h2d_stage
            )
        plan.issue(h2d)
        self.stats.h2d_bytes += (pages - first) * self._page_bytes
        # why: the compute stream waits on this before reading the slot
        slot.ready = slot.ready_ev = record(h2d, slot.ready_ev)
        slot.pages = pages
        self.stats.pages_gathered += pages - first
        return pages - first

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
