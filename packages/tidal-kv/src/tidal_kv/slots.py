"""Device gather slots of :class:`~tidal_kv.PagedKVCache` and the cached plans of their page gathers.

A decode step gathers every offloaded layer's full pages ``[0, pages)`` again, with the same tensors as the
step before until a page fills. Building the views of such a gather (host chunk range, slot range, staging
range for quantized pages) costs more host time than issuing its copy, so each slot keeps the plan of its
last gather per layer (:class:`GatherPlan`, of :class:`GatherRun` s) and rebuilds it only when the page range
changes.

[Note: gather graphs] A gather of NF4 pages is two copies and a dequantization launch: 61 µs of host time
on the GPU machine issued call by call, most of it the Triton launch; fp8's 52 (``kv-host-costs-gathers-*``).
From its second use a plan of more than one operation is captured as one CUDA graph
(:class:`tidal_arena.StreamGraph`) and replayed with one launch, 6.5 µs. An 8B decode step with NF4 pages
went from 0.78-0.81 to 0.87-0.90x DynamicCache at 32k x 1 and 4k x 1 (``kv-variants-nf4-graphs-*``). The
graph holds the plan's pointers, which stay valid as long as the plan: host chunks are only appended to, and
the slot and the staging chunk live as long as the slot that holds the plan. Where a capture fails, every
later gather of the process stays eager (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tidal_arena import RowCopy, StreamGraph
from tidal_kv.stats import KVStats
from tidal_kv.storage import ChunkLayout, PageChunk
from tidal_kv.streams import on
from tidal_kv.views import KVRange, TokenRange


class GatherRun(NamedTuple):
    """One contiguous run of ``m`` pages of a gather (inside one host chunk): its views and copies."""

    m: int
    """Pages in the run."""
    dst: torch.Tensor
    """``[2, B, H, m·P, D]`` the slot's token range of these pages."""
    copies: tuple[RowCopy, ...]
    """The host-to-device copies of the run, checked once: the pages (into ``dst``, or for quantized storage
    into a contiguous device staging), then for quantized storage their scales."""
    decode: Callable[[], Any] | None
    """Quantized storage: dequantizes the staged pages into ``dst`` (:meth:`PageChunk.decoder`); None for
    native storage, whose pages land in ``dst`` directly."""


logger = logging.getLogger(__name__)
_capture_failed: list[str] = []  # why a capture failed in this process (then no plan captures again)


@dataclass(eq=False)
class GatherPlan:
    """The runs of one gather (a layer's pages ``[first, pages)`` into one slot), issued eagerly on first use
    and replayed as one CUDA graph from the second (see [Note: gather graphs])."""

    key: tuple[int, int]
    """``(first, pages)``: the page range."""
    runs: list[GatherRun]
    """The runs in page order."""
    uses: int = 0
    """Times issued."""
    graph: StreamGraph | None = None
    """The captured plan, once captured."""
    capture: bool = True
    """Whether to capture on the next use (False: one operation only, or a capture failed)."""

    def __post_init__(self) -> None:
        ops = sum(len(run.copies) + (run.decode is not None) for run in self.runs)
        self.capture = ops > 1  # why: a single copy costs no more to issue than a graph launch

    def issue(self, stream: Any, capture_stream: Any = None) -> None:
        """Queue the gather on ``stream``: the H2D stream, the compute stream, or None on the CPU (copies run
        at once). A capture runs on ``capture_stream`` (default ``stream``): a side stream, since the compute
        stream may be the legacy default stream, which cannot capture; the graph then launches on ``stream``."""
        if self.graph is not None:
            self.graph.launch(stream)  # why: the gather's stream (see [Note: gathers on the compute stream])
            return
        self.uses += 1
        capture_on = stream if capture_stream is None else capture_stream
        if self.uses > 1 and self.capture and capture_on is not None and not _capture_failed:
            self.capture = False  # one attempt per plan
            try:
                self.graph = StreamGraph.capture(capture_on, lambda: self._queue(capture_on))
            except RuntimeError as exc:  # e.g. a decoder that allocates: stay eager, and say why once
                _capture_failed.append(str(exc))
                logger.warning("page gathers stay uncaptured in this process: %s", exc)
            if self.graph is not None:
                self.graph.launch(stream)  # why: see above
                return
        self._queue(stream)

    def _queue(self, stream: Any) -> None:
        """Issue every run's copies and dequantization on ``stream``, one call each."""
        for run in self.runs:
            for copy in run.copies:
                copy(stream)  # why: on the H2D stream, so it runs while the compute stream works
            if run.decode is not None:
                # why: the dequantization reads the staging the copies above fill: same stream, in order
                with on(stream):
                    run.decode()


@dataclass(eq=False)
class Slot:
    """A device buffer an offloaded layer is gathered into; ``owner``'s first ``pages`` pages are valid.

    Slots compare by identity (``eq=False``): the cache tests membership of slots in small lists.
    """

    kv: torch.Tensor  # [2, B, H, cap, D]: K and V in one buffer, so one copy moves both
    owner: int | None = None
    pages: int = 0
    ready: Any = None  # event: the H2D copy into this slot finished
    free_after: Any = None  # event: the compute stream finished reading the previous owner's K/V
    prefetched_pages: int = 0
    # long-lived events re-recorded each step (see `streams.record`): the decode loop creates none
    ready_ev: Any = None
    free_ev: Any = None
    # views made once (indexing kv per update costs host time on every decode step)
    k: torch.Tensor = field(init=False)  # [B, H, cap, D], kv[0]
    v: torch.Tensor = field(init=False)  # [B, H, cap, D], kv[1]
    kv_at: TokenRange = field(init=False)  # token ranges of kv, [2, B, H, n, D]
    both: KVRange = field(init=False)  # ... of k and v, [B, H, n, D] each
    # layer -> the plan of the last gather of that layer into this slot
    plans: dict[int, GatherPlan] = field(init=False, default_factory=dict)
    # page index -> kv's [2, B, H, P, D] view of that page (see `page`)
    _pages: dict[int, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.k, self.v = self.kv.unbind(0)
        self.kv_at, self.both = TokenRange(self.kv), KVRange(self.k, self.v)

    def page(self, index: int, page_tokens: int) -> torch.Tensor:
        """The ``[2, B, H, P, D]`` view of page ``index`` (made on first use, then kept: a decode step copies
        a layer's partial page into the same page of a slot for ``page_tokens`` steps in a row)."""
        view = self._pages.get(index)
        if view is None:
            view = self._pages[index] = self.kv_at(index * page_tokens, page_tokens)
        return view

    def gather_plan(
        self,
        layer: int,
        first: int,
        pages: int,
        chunks: list[PageChunk],
        layout: ChunkLayout,
        stage: PageChunk | None,
    ) -> GatherPlan:
        """The plan that gathers ``layer``'s pages ``[first, pages)`` from ``chunks`` into this slot.

        Args:
            layer: The offloaded layer (the cache key, with the page range).
            first: First page to gather.
            pages: One past the last page.
            chunks: The layer's host chunks, ``[2, B, H, C·P, D]`` each (only ever appended to).
            layout: Their layout (pages per chunk, tokens per page).
            stage: quantized storage: the device staging chunk the pages land in before dequantization; else
                None.

        Returns:
            The plan; cached, so the same range returns the same plan (views, graph) without rebuilding it.
        """
        key = (first, pages)
        hit = self.plans.get(layer)
        if hit is not None and hit.key == key:
            return hit
        p, cp = layout.page_tokens, layout.chunk_pages
        runs = []
        page = first
        while page < pages:
            chunk, i0 = divmod(page, cp)
            m = min(cp - i0, pages - page)
            src = chunks[chunk].tokens(i0 * p, (i0 + m) * p)
            dst = self.kv[:, :, :, page * p : (page + m) * p]
            if stage is None:  # native pages: the host rows land straight in the slot's token range
                runs.append(GatherRun(m, dst, (RowCopy(dst, src.data, 3),), None))
            else:
                staged = stage.packed(m * p)
                copies = (RowCopy(staged.data, src.data, 3), RowCopy(staged.scale, src.scale, 3))
                runs.append(GatherRun(m, dst, copies, staged.decoder(dst)))
            page += m
        plan = self.plans[layer] = GatherPlan(key, runs)
        return plan


def pick_slot(
    slots: list[Slot], pending: dict[int, Slot], current: Slot | None, layer: int, stats: KVStats
) -> Slot:
    """A slot for ``layer``: one not promised to a pending prefetch, preferring one that already holds it.

    Args:
        slots: Every slot of the cache.
        pending: Offloaded layer -> the slot its queued prefetch fills (a taken-back prefetch is removed).
        current: The slot the last update returned (still read by attention), or None.
        layer: The offloaded layer to place.
        stats: Counts the pages a reused slot already holds.

    Returns:
        The slot, owned by ``layer``; its ``pages`` are the valid pages it already holds of it.
    """
    busy = [*pending.values(), current]  # `in` compares slots by identity (eq=False)
    free = [s for s in slots if s not in busy]
    if not free:
        # updates out of stack order: take back the oldest prefetch (its slot keeps its owner's pages)
        oldest = next(iter(pending))
        free = [pending.pop(oldest)]
    slot = None
    for s in free:
        if s.owner == layer:
            slot = s
            break
    if slot is None:
        # least useful first: a slot no one owns, else the one holding the fewest pages (first such one)
        slot = free[0]
        for s in free[1:]:
            if (s.owner is not None, s.pages) < (slot.owner is not None, slot.pages):
                slot = s
        slot.owner, slot.pages = layer, 0
    else:
        stats.pages_reused += slot.pages
    slot.prefetched_pages = 0
    return slot


def prefetch_order(layer: int, offloaded: list[int], n_slots: int) -> tuple[int, ...]:
    """The offloaded layers an update of ``layer`` prefetches: the next ones after it, cyclically (the next
    step's first), ``n_slots - 1`` of them (fewer when there are fewer other offloaded layers).

    One slot is always left out: the one the previous offloaded layer's attention reads, or just read. It is
    refilled one update later, when that attention has usually finished on the device, so its gather needs no
    wait on the compute stream (see [Note: completed events] in :mod:`tidal_kv.streams`).

    Args:
        layer: The layer being updated.
        offloaded: The offloaded layers, sorted.
        n_slots: Device gather slots.
    """
    live = 1 if layer in offloaded else 0
    n_off = len(offloaded)
    start = next((i for i, o in enumerate(offloaded) if o > layer), 0)  # the first offloaded one after it
    return tuple(offloaded[(start + i) % n_off] for i in range(min(n_slots - 1, n_off - live)))
