"""Device gather slots of :class:`~tidal_kv.PagedKVCache` and the cached plans of their page gathers.

A decode step gathers every offloaded layer's full pages ``[0, pages)`` again, with the same tensors as the
step before until a page fills. Building the views of such a gather (host chunk range, slot range, staging
range for quantized pages) costs more host time than issuing its copy, so each slot keeps the plan of its
last gather per layer (:class:`GatherPlan`, of :class:`GatherRun` s) and rebuilds it only when the page range
changes.

[Note: gather graphs] A gather of NF4 pages is two copies and a dequantization launch: 61 µs of host time
on the GPU machine issued call by call, most of it the Triton launch; fp8's 52 (``kv-host-costs-gathers-*``).
From its second use a plan's copies (when more than one) and its dequantization (with the partial page's
copy, see [Note: dequantization off the link]) are each captured as one CUDA graph
(:class:`tidal_arena.StreamGraph`, via :class:`ReplayedCalls`) and replayed with one launch, 6.5 µs. An 8B
decode step with NF4 pages went from 0.78-0.81 to 0.87-0.90x DynamicCache at 32k x 1 and 4k x 1
(``kv-variants-nf4-graphs-*``, copies and dequantization then in one graph). Copies issued call by call
instead of replayed read 0.856 against 0.873x at NF4 32k x 1 in the same rounds (``kv-nf4-decode-off-link``).
A graph holds its plan's pointers, which stay valid as long as the plan: host chunks are only appended to,
and the slot, its staging and the layer's partial page live as long as the slot that holds the plan.
Where a capture fails, every later gather of the process stays eager (logged once).
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
from tidal_kv.views import KVRange, RowWrites, TokenRange


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


class ReplayedCalls:
    """Calls that queue work on one stream, issued eagerly on first use and replayed as one CUDA graph from
    the second (see [Note: gather graphs]).

    Args:
        calls: Each takes the stream to queue on (None on the CPU, where work runs at once).
        capture: Whether to capture on the second use (False: not worth a graph, e.g. a single copy).
    """

    __slots__ = ("calls", "capture", "graph", "uses")

    def __init__(self, calls: tuple[Callable[[Any], None], ...], capture: bool) -> None:
        self.calls = calls
        self.capture = capture
        self.uses = 0
        self.graph: StreamGraph | None = None

    def issue(self, stream: Any, capture_stream: Any = None) -> None:
        """Queue the calls on ``stream``: a side stream, the compute stream, or None on the CPU. A capture runs
        on ``capture_stream`` (default ``stream``): a side stream, since the compute stream may be the legacy
        default stream, which cannot capture; the graph then launches on ``stream``."""
        if self.graph is not None:
            self.graph.launch(stream)  # why: the caller's stream orders the replay (see the callers)
            return
        self.uses += 1
        capture_on = stream if capture_stream is None else capture_stream
        if self.uses > 1 and self.capture and capture_on is not None and not _capture_failed:
            self.capture = False  # one attempt
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
        for call in self.calls:
            call(stream)


def _on_stream(fn: Callable[[], Any]) -> Callable[[Any], None]:
    """``fn`` (which queues on the current stream) as a call that queues on a given stream."""

    def call(stream: Any) -> None:
        with on(stream):  # why: the stream the caller orders this work on
            fn()

    return call


@dataclass(eq=False)
class GatherPlan:
    """The runs of one gather (a layer's pages ``[first, pages)`` into one slot) as two replayed parts.

    [Note: dequantization off the link] Quantized pages are copied into the slot's staging buffer by the
    gather (:attr:`copies`, on the H2D stream) and dequantized into the slot only by the layer's own update
    (:attr:`finish`, on the compute stream, just before attention reads them). Dequantized on the H2D stream
    instead, each gather's kernels held the link idle until they finished: in an 8B decode step at 4k x 16
    with NF4 pages, 1.45 ms of the H2D stream's 22.9 ms per step (profiled). Where the link decides, the step
    now runs at its floor: NF4 16k x 16 89.6 ms against 97.1 with the dequantization on the H2D stream, in the
    same rounds, for 88 ms of copies (``kv-nf4-decode-off-link``). The price is VRAM: each slot keeps its own
    staging buffer, the capacity's pages in their stored format (0.28x a slot for NF4), since a gather into
    one slot may land while the other slot's pages are still being dequantized.
    """

    key: tuple[int, int]
    """``(first, pages)``: the page range."""
    runs: list[GatherRun]
    """The runs in page order."""
    tail_copy: Callable[[Any], None] | None = None
    """Quantized storage: copies the layer's partial page behind the gathered pages (the decode step's last
    write before attention), replayed with the dequantization; None for native pages or a test's plan."""
    copies: ReplayedCalls = field(init=False)
    """Every run's host-to-device copies; a single copy costs no more to issue than a graph launch, so it is
    never captured."""
    finish: ReplayedCalls | None = field(init=False)
    """Quantized storage: every run's dequantization, then :attr:`tail_copy`; None for native pages."""

    def __post_init__(self) -> None:
        copies = tuple(c for run in self.runs for c in run.copies)
        self.copies = ReplayedCalls(copies, capture=len(copies) > 1)
        decodes = tuple(_on_stream(run.decode) for run in self.runs if run.decode is not None)
        tail = (self.tail_copy,) if self.tail_copy is not None else ()
        self.finish = ReplayedCalls(decodes + tail, capture=True) if decodes else None
        self.issue = self.copies.issue  # one call frame less per gather on the decode path

    @property
    def graph(self) -> StreamGraph | None:
        """The copies' graph, once captured."""
        return self.copies.graph

    issue: Callable[..., None] = field(init=False)
    """``issue(stream, capture_stream=None)``: queue the gather's copies on ``stream`` (:meth:`ReplayedCalls.issue`
    of :attr:`copies`)."""

    def decode_now(self) -> None:
        """Dequantize the staged pages on the current stream, call by call (the rare paths: a prefill, a page
        boundary, pages gathered in more than one piece)."""
        for run in self.runs:
            if run.decode is not None:
                run.decode()


@dataclass(eq=False)
class Slot:
    """A device buffer an offloaded layer is gathered into; ``owner``'s first ``pages`` pages are valid once
    the gathers in :attr:`staged` are finished (see [Note: dequantization off the link]).

    Slots compare by identity (``eq=False``): the cache tests membership of slots in small lists.
    """

    kv: torch.Tensor  # [2, B, H, cap, D]: K and V in one buffer, so one copy moves both
    stage: PageChunk | None = None  # quantized storage: [2, B, H, cap, ·] packed pages, copied in by gathers
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
    # gathers whose pages sit in `stage`, not dequantized into `kv` yet (in order)
    staged: list[GatherPlan] = field(init=False, default_factory=list)
    # page index -> kv's [2, B, H, P, D] view of that page (see `page`)
    _pages: dict[int, torch.Tensor] = field(init=False, default_factory=dict)
    # copies into kv's token ranges as one memcpy (see [Note: token writes] in tidal_kv.views); None on the CPU
    _rows: RowWrites | None = field(init=False)
    # the K and V views `upto` handed out last, and their length
    _upto: tuple[torch.Tensor, torch.Tensor] | None = field(init=False, default=None)
    _upto_n: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self.k, self.v = self.kv.unbind(0)
        self.kv_at, self.both = TokenRange(self.kv), KVRange(self.k, self.v)
        self._rows = RowWrites.of(self.kv)

    def take(self, layer: int | None) -> None:
        """Give the slot to ``layer`` (None: to no one), holding none of its pages."""
        self.owner, self.pages = layer, 0
        self.staged.clear()  # why: another layer's staged pages are no use to this one

    def page(self, index: int, page_tokens: int) -> torch.Tensor:
        """The ``[2, B, H, P, D]`` view of page ``index`` (made on first use, then kept: a decode step copies
        a layer's partial page into the same page of a slot for ``page_tokens`` steps in a row)."""
        view = self._pages.get(index)
        if view is None:
            view = self._pages[index] = self.kv_at(index * page_tokens, page_tokens)
        return view

    def upto(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[B, H, n, D]`` K and V views of tokens ``[0, n)``: the same two tensors for every layer that reads
        ``n`` tokens of this slot in a row, as the offloaded layers of one decode step do (half of them per slot
        with two slots), so a step makes one pair of views per slot instead of one per layer."""
        if n != self._upto_n:
            self._upto, self._upto_n = self.both.upto(n), n
        return self._upto

    def copy_page(self, index: int, page_tokens: int, tail: torch.Tensor) -> None:
        """Copy a layer's contiguous partial page ``tail`` ``[2, B, H, P, D]`` into page ``index`` (on the current
        stream: one memcpy where the slot allows, else ``copy_`` into :meth:`page`'s view)."""
        if self._rows is not None:
            self._rows.rows(index * page_tokens, tail)
        else:
            self.page(index, page_tokens).copy_(tail)

    def gather_plan(
        self,
        layer: int,
        first: int,
        pages: int,
        chunks: list[PageChunk],
        layout: ChunkLayout,
        tail: torch.Tensor | None = None,
    ) -> GatherPlan:
        """The plan that gathers ``layer``'s pages ``[first, pages)`` from ``chunks`` into this slot.

        Args:
            layer: The offloaded layer (the cache key, with the page range).
            first: First page to gather.
            pages: One past the last page.
            chunks: The layer's host chunks, ``[2, B, H, C·P, D]`` each (only ever appended to).
            layout: Their layout (pages per chunk, tokens per page).
            tail: The layer's partial page ``[2, B, H, P, D]``; quantized storage copies it behind the pages
                when it finishes the gather (:attr:`GatherPlan.tail_copy`).

        Returns:
            The plan; cached, so the same range returns the same plan (views, graphs) without rebuilding it.
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
            if self.stage is None:  # native pages: the host rows land straight in the slot's token range
                runs.append(GatherRun(m, dst, (RowCopy(dst, src.data, 3),), None))
            else:  # each run's pages at their own place in the staging buffer, dequantized by `finish`
                staged = self.stage.packed(m * p, page * p)
                copies = (RowCopy(staged.data, src.data, 3), RowCopy(staged.scale, src.scale, 3))
                runs.append(GatherRun(m, dst, copies, staged.decoder(dst)))
            page += m
        tail_copy = None
        if self.stage is not None and tail is not None and (pages + 1) * p <= self.kv.shape[3]:
            behind = self.page(pages, p)  # [2, B, H, P, D]
            tail_copy = _on_stream(lambda: behind.copy_(tail))
        plan = self.plans[layer] = GatherPlan(key, runs, tail_copy)
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
        slot.take(layer)
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
