"""`PagedKVCache`: resident layers' K/V in VRAM, offloaded layers' K/V in host pages gathered ahead of use.

[Note: slot lifetime] Offloaded layers attend from one of ``prefetch_slots`` preallocated device slots. The
K/V that :meth:`PagedKVCache.update` returns for an offloaded layer stay valid until the next ``update`` call
(of any layer): that next call is where the slot is handed back and may be refilled. This is exactly the
order of a decoder stack (layer l attends before layer l+1 computes its K/V). Host pages are only ever
appended; the one partial page of each offloaded layer stays on the device (its "tail").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

from tidal_kv.config import (
    KVConfig,
    LayerBytes,
    ResidentSpec,
    Storage,
    check_head_dim,
    place_layers,
    same_layout,
)
from tidal_kv.errors import KVConfigError
from tidal_kv.policy import GatherStream, GatherStreamPolicy
from tidal_kv.slots import Slot, pick_slot, prefetch_order
from tidal_kv.stats import KVStats
from tidal_kv.storage import (
    ChunkLayout,
    HostPagePool,
    PageChunk,
    balanced_chunk_pages,
    device_chunk,
)
from tidal_kv.streams import CurrentStream, ranged, record, wait
from tidal_kv.transfers import PageTransfers
from tidal_kv.views import KVRange, TailPage

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 64 << 20  # target bytes of one host chunk / staging copy (K and V of several pages)


class PagedKVCache(PageTransfers):
    """A paged KV cache whose offloaded layers live in host pages and are prefetched into device slots.

    Args:
        num_layers: Attention layers.
        max_tokens: Tokens per sequence to preallocate; longer sequences reallocate (logged).
        num_kv_heads: K/V heads (None: from the first update).
        head_dim: Head dimension (None: from the first update).
        batch_size: Sequences per batch (None: from the first update).
        resident_layers: "auto", a count, or explicit layer indices kept in VRAM.
        page_tokens: Tokens per host page.
        vram_budget: Bytes of VRAM for "auto" placement (None: ``vram_fraction`` of free VRAM).
        vram_fraction: Fraction of free VRAM for "auto" placement when ``vram_budget`` is None.
        dtype: K/V dtype (None: the first update's).
        storage: Host page format, "native", "fp8" or "nf4" (see :attr:`KVConfig.storage`).
        device: Device (None: the first update's).
        prefetch_slots: Device gather slots for offloaded layers (2 or 3).
        gather_stream: Where gathers are issued: "side", "compute" or "auto" (see :attr:`KVConfig.gather_stream`).

    Raises:
        KVConfigError: a bad option (it names the option, the value, and what is accepted).
    """

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        batch_size: int | None = None,
        resident_layers: ResidentSpec = "auto",
        page_tokens: int = 256,
        vram_budget: int | None = None,
        vram_fraction: float = 0.5,
        dtype: torch.dtype | None = None,
        storage: Storage = "native",
        device: torch.device | str | None = None,
        prefetch_slots: int = 2,
        gather_stream: GatherStream = "auto",
    ) -> None:
        if isinstance(resident_layers, Sequence) and not isinstance(resident_layers, str):
            resident_layers = tuple(resident_layers)
        self.config = KVConfig(
            num_layers=num_layers,
            max_tokens=max_tokens,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            batch_size=batch_size,
            resident_layers=resident_layers,
            page_tokens=page_tokens,
            vram_budget=vram_budget,
            vram_fraction=vram_fraction,
            dtype=dtype,
            storage=storage,
            device=device,
            prefetch_slots=prefetch_slots,
            gather_stream=gather_stream,
        )
        self.stats = KVStats()
        self._policy = GatherStreamPolicy(gather_stream)
        self._inline = self._policy.inline  # gathers on the compute stream (read on every gather)
        self._inline_used = False  # some gather ran on the compute stream (then syncs include it)
        # read on every update (the config holds the same, checked values)
        self._page_tokens, self._num_layers = page_tokens, num_layers
        self._lengths = [0] * num_layers
        self._shape: tuple[int, int, int] | None = None  # (B, H, D) once materialized
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._capacity = 0
        self._resident: list[int] = []
        self._offloaded: list[int] = []
        self._free_all()

    # ------------------------------------------------------------------ public API

    def __del__(self) -> None:
        # [Note: slot lifetime] the slots and staging chunks were allocated on the compute stream but are
        # written on the H2D stream; the caching allocator only tracks the compute stream, so drain the copy
        # streams before the memory can be handed out again (a no-op on the CPU and at interpreter shutdown)
        with contextlib.suppress(Exception):
            self._sync_copies()

    @property
    def num_layers(self) -> int:
        """Attention layers in the cache."""
        return self.config.num_layers

    @property
    def resident_layers(self) -> list[int]:
        """Layers whose K/V stay in VRAM (known after the first update unless shapes were given)."""
        return list(self._resident)

    @property
    def offloaded_layers(self) -> list[int]:
        """Layers whose full pages live on the host."""
        return list(self._offloaded)

    @property
    def capacity(self) -> int:
        """Tokens per sequence the device buffers hold now (``max_tokens`` until a longer sequence came)."""
        return self._capacity

    def seq_length(self, layer: int = 0) -> int:
        """Tokens cached for ``layer``."""
        self._check_layer(layer)
        return self._lengths[layer]

    @ranged("tidal::kv_update")
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` to ``layer`` and return all its K/V.

        Args:
            layer: Layer index.
            k: ``[B, H, T_new, D]`` new keys.
            v: ``[B, H, T_new, D]`` new values.

        Returns:
            ``(keys, values)``, each ``[B, H, T_past + T_new, D]`` on the cache's device. For an offloaded layer
            they are views into a shared slot, valid until the next ``update`` call (see module note).

        Raises:
            KVConfigError: ``k``/``v`` do not match the cache (shape, dtype, device) or ``layer`` is out of range.
        """
        # [Note: decode host path] a batch-1 decode step is bound by the host, and this runs once per layer
        # and step. A decode token's update (one token; for an offloaded layer, its slot prefetched and no
        # page filling) takes a flat path, `_step_resident` / `_step_offloaded`, with views made once where
        # steps repeat them (`Slot.page`, `Slot.upto`, `TailPage.write`'s CPU views); everything else (prefill,
        # page boundaries, on-demand gathers, growth, the first update) takes `_update`, which checks and
        # explains. Measured:
        # the cache-only loop of `benchmarks/kv/overhead.py` went from 20-21 to 16-17 µs per layer on a CPU;
        # in a whole 8B decode step on the GPU machine the gain stayed inside the rounds' spread
        # (`benchmarks/kv/ab.py`; results `diag-kv-ab-*`).
        token = self._token_shape  # [B, H, 1, D] once the shapes are known, else None
        if (
            type(layer) is int
            and 0 <= layer < self._num_layers
            and type(k) is torch.Tensor
            and type(v) is torch.Tensor
            and k.shape == token
            and v.shape == token
            and k.dtype is self._dtype  # why `is`: dtypes are singletons
            and v.dtype is self._dtype
            and k.device == self._device
            and v.device == self._device
            and not (k.requires_grad or v.requires_grad)
            and self._lengths[layer] < self._capacity
        ):
            if self._timing and (layer == 0 or layer == self._num_layers - 1):
                self._time_step(layer)
            if layer not in self._offloaded_set:
                return self._step_resident(layer, k, v)
            slot = self._pending.get(layer)
            s, p = self._lengths[layer], self._page_tokens
            if slot is not None and (s + 1) % p and slot.pages >= s // p:
                return self._step_offloaded(layer, k, v, slot)
        return self._update(layer, k, v)

    def _step_resident(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token of a resident layer (see [Note: decode host path])."""
        cur = self._current
        if cur is not None:
            if not self._inline:
                # why: hand back the slot the previous update returned (see `_release_current`)
                cur.free_after = cur.free_ev = record(self._compute(), cur.free_ev)
            self._current = None
        s = self._lengths[layer]
        out = self._res_at[layer].append(s, k, v)  # [B, H, s + 1, D] each
        self._lengths[layer] = s + 1
        if self._ahead:
            self._prefetch_ahead(layer)
        return out

    def _step_offloaded(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slot: Slot
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token of an offloaded layer whose full pages were prefetched into ``slot`` and whose
        partial page does not fill (see [Note: decode host path])."""
        current_stream = self._current_stream  # `_compute()` without its call frame: None on the CPU
        compute = current_stream() if current_stream is not None else None
        cur = self._current
        if cur is not None and not self._inline:
            # why: hand back the slot the previous update returned (see `_release_current`)
            cur.free_after = cur.free_ev = record(compute, cur.free_ev)
        del self._pending[layer]
        if slot.prefetched_pages:
            self.stats.prefetched += 1
        self._current = slot
        if slot.ready is not None:
            wait(compute, slot.ready)  # why: the gathered pages must land before the slot is read or written
            slot.ready = None
        s, p = self._lengths[layer], self._page_tokens
        page, t = divmod(s, p)
        tail = self._tails[layer]
        tail.write(t, k, v)
        # the whole partial page (K and V, all P tokens: one fixed view; attention reads its first t + 1)
        # goes behind the gathered pages; staged quantized pages are dequantized with it
        if slot.staged:
            self._finish(slot, compute, page, tail.buf)
        else:
            slot.copy_page(page, p, tail.buf)
        self._lengths[layer] = s + 1
        if self._ahead:
            self._prefetch_ahead(layer)
        return slot.upto(s + 1)

    def _update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` in general: checks every argument, materializes, grows, gathers on demand."""
        if not (
            type(layer) is int
            and 0 <= layer < self.config.num_layers
            and self._shape is not None
            and same_layout(k, v, self._shape, self._dtype, self._device)
            and not (k.requires_grad or v.requires_grad)
        ):
            self._check_layer(layer)
            self._check_kv(k, v)
            if self._shape is None:
                self._materialize(k)
        offloaded = layer in self._offloaded_set
        compute = self._compute()
        self._release_current(compute)
        if k.shape[2] > 1 and self._timing:
            self._policy.restart()  # a prefill is not a decode step
        new_len = self._lengths[layer] + k.shape[2]
        if new_len > self._capacity:
            self._grow(new_len)
        if offloaded:
            out = self._update_offloaded(layer, k, v, compute)
        else:
            out = self._update_resident(layer, k, v)
        self._lengths[layer] = new_len
        if self._ahead:
            self._prefetch_ahead(layer)
        return out

    def reset(self) -> None:
        """Forget every cached token (buffers are kept for the next sequence of the same shape)."""
        self._sync_copies()
        self._policy.restart()
        self._lengths = [0] * self.num_layers
        self._pending.clear()
        self._current = None
        for slot in self._slots:
            slot.take(None)
            slot.ready, slot.free_after = None, None
        self._flush_done = {}

    def memory(self) -> dict[str, Any]:
        """Where the cache's bytes are.

        Returns:
            ``device`` (str), ``resident_layers``, ``offloaded_layers``, ``capacity_tokens``, ``tokens`` (longest
            layer), ``device_bytes`` (resident buffers + slots + tails + staging), ``host_bytes`` (pages),
            ``host_pages`` (filled pages on the host), ``all_resident_device_bytes`` (what keeping every layer in
            VRAM would take at this capacity) and ``device_bytes_saved``.
        """
        dev = 0
        for kv_at in self._res_at.values():
            dev += 2 * kv_at.k.numel() * kv_at.k.element_size()
        for s in self._slots:
            dev += 2 * s.k.numel() * s.k.element_size() + (s.stage.nbytes if s.stage is not None else 0)
        for tail_page in self._tails.values():
            dev += tail_page.buf.numel() * tail_page.buf.element_size()
        dev += self._d2h_stage.nbytes if self._d2h_stage is not None else 0
        all_res = 0
        if self._shape is not None:
            b, h, d = self._shape
            all_res = self.num_layers * 2 * b * h * self._capacity * d * self._dtype.itemsize
        host_pages = sum(self._lengths[i] // self.config.page_tokens for i in self._offloaded)
        return {
            "device": str(self._device) if self._device is not None else None,
            "resident_layers": list(self._resident),
            "offloaded_layers": list(self._offloaded),
            "capacity_tokens": self._capacity,
            "tokens": max(self._lengths),
            "device_bytes": dev,
            "host_bytes": self._pool.nbytes if self._pool is not None else 0,
            "host_pages": host_pages,
            "all_resident_device_bytes": all_res,
            "device_bytes_saved": all_res - dev,
        }

    # ------------------------------------------------------------------ checks

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise KVConfigError(
                f"layer={layer!r} is not accepted: expected an int in [0, num_layers={self.num_layers})."
            )

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        KVConfig.check_no_grad(k, v)
        if self._shape is not None and same_layout(k, v, self._shape, self._dtype, self._device):
            return  # the common decode case; after the full checks below, a mismatch is a real one
        self.config.check_update(k, v)
        if self._shape is None:
            return
        b, h, d = self._shape
        if any(self._lengths):
            raise KVConfigError(
                f"k {tuple(k.shape)} {k.dtype} on {k.device} does not match the cached sequence "
                f"[{b}, {h}, *, {d}] {self._dtype} on {self._device}: call reset() before a new batch shape."
            )
        self._note(f"shapes changed after reset to {tuple(k.shape)} {k.dtype}: reallocating")
        self.stats.reallocations += 1
        self._free_all()

    # ------------------------------------------------------------------ allocation

    def _note(self, msg: str, level: int = logging.INFO) -> None:
        logger.log(level, msg)
        self.stats.events.append(msg)

    def _free_all(self) -> None:
        """Drop every buffer (before the first update, or to re-materialize for new shapes)."""
        if getattr(self, "_pool", None) is not None:
            self._sync_copies()
            self._pool.release()
        self._shape = None
        self._token_shape: torch.Size | None = None  # a decode token's [B, H, 1, D] (`update`'s fast test)
        self._pool: HostPagePool | None = None
        # resident layer -> its [B, H, cap, D] K and V buffers, as token ranges (`.buf` is the buffer)
        self._res_at: dict[int, KVRange] = {}
        # offloaded layer -> its device partial page ("tail", [2, B, H, P, D])
        self._tails: dict[int, TailPage] = {}
        self._host: dict[int, list[PageChunk]] = {}
        self._slots: list[Slot] = []
        self._pending: dict[int, Slot] = {}
        self._current: Slot | None = None
        self._flush_done: dict[int, Any] = {}  # layer -> event: its last D2H page copy finished
        self._d2h_free: Any = None  # event: the D2H staging chunk may be overwritten
        self._d2h_stage: PageChunk | None = None
        self._offloaded_set: frozenset[int] = frozenset()
        self._ahead: list[tuple[int, ...]] = []  # per layer: the offloaded layers its update prefetches
        self._h2d = self._d2h = None
        self._current_stream: CurrentStream | None = None
        self._cuda = False
        self._timing = False  # "auto" gather streams time decode steps (set once the link is measured)

    def _bytes(self) -> tuple[int, int, int]:
        """(page bytes in storage format, device bytes per token per layer K+V, element size)."""
        b, h, d = self._shape
        elt = self._dtype.itemsize
        page = ChunkLayout(1, b, h, self.config.page_tokens, d, self._dtype, self._storage)
        return page.data_bytes + page.scale_bytes, 2 * b * h * d * elt, elt

    def _materialize(self, k: torch.Tensor) -> None:
        c = self.config
        self._shape = (k.shape[0], k.shape[1], k.shape[3])
        self._token_shape = torch.Size((k.shape[0], k.shape[1], 1, k.shape[3]))
        self._dtype, self._device = k.dtype, k.device
        self._storage = c.storage
        self._quantized = c.storage != "native"  # pages are staged in their format, then dequantized
        check_head_dim(c.storage, self._shape[2])
        self._cuda = self._device.type == "cuda"
        p = c.page_tokens
        self._capacity = -(-c.max_tokens // p) * p  # whole pages
        page_store, per_token, _ = self._bytes()
        self._chunk_pages = balanced_chunk_pages(self._capacity // p, _CHUNK_BYTES // max(page_store, 1))
        self._place(per_token)
        self._offloaded_set = frozenset(self._offloaded)
        b, h, d = self._shape
        if self._cuda:
            self._current_stream = CurrentStream(self._device)
        for layer in self._resident:
            self._set_resident(layer, *self._empty_kv(self._capacity))
        if not self._offloaded:
            return
        if self._cuda:
            # why: page gathers overlap the layers computing before them
            self._h2d = torch.cuda.Stream(self._device)
            # why: filled pages drain to the host off the compute path
            self._d2h = torch.cuda.Stream(self._device)
        self._pool = HostPagePool(pin=self._cuda)
        for ev in self._pool.events:
            self.stats.events.append(ev)
        self._chunk_layout = ChunkLayout(self._chunk_pages, b, h, p, d, self._dtype, self._storage)
        per_chunk = HostPagePool.chunk_bytes(self._chunk_layout)
        chunks = -(-self._capacity // p // self._chunk_pages)
        self._pool.reserve(len(self._offloaded) * chunks * per_chunk)
        for layer in self._offloaded:
            tail = torch.empty(2, b, h, p, d, dtype=self._dtype, device=self._device)
            self._tails[layer] = TailPage(tail)
            self._host[layer] = []
            self._ensure_host_pages(layer, self._capacity // p)
        n_slots = min(c.prefetch_slots, len(self._offloaded))
        self._slots = [self._new_slot(self._capacity) for _ in range(n_slots)]
        self._ahead = [prefetch_order(layer, self._offloaded, n_slots) for layer in range(c.num_layers)]
        self._page_bytes = (
            self._chunk_layout.data_bytes + self._chunk_layout.scale_bytes
        ) // self._chunk_pages
        self._d2h_stage = device_chunk(self._chunk_layout, self._device)
        if self._cuda and self._policy.measuring:
            self._measure_link()
            self._timing = True

    def _time_step(self, layer: int) -> None:
        """A decode token of the first or last layer: time the step's span, and let ``gather_stream="auto"``
        decide at its end (see :mod:`tidal_kv.policy`)."""
        if layer == self._num_layers - 1:  # first: with one layer, it ends the last step and begins the next
            first = self._offloaded[0]
            step_bytes = len(self._offloaded) * (self._lengths[first] // self._page_tokens) * self._page_bytes
            if self._policy.end_step(step_bytes, self._shape[0]):
                self._set_inline(self._policy.inline)
        if layer == 0:
            self._policy.begin_step()

    def _set_resident(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._res_at[layer] = KVRange(k, v)

    def _empty_kv(self, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d = self._shape
        mk = lambda: torch.empty(b, h, cap, d, dtype=self._dtype, device=self._device)  # noqa: E731
        return mk(), mk()

    def _new_slot(self, cap: int) -> Slot:
        """A gather slot of ``cap`` tokens ``[2, B, H, cap, D]``, with a staging buffer for quantized pages
        (see [Note: dequantization off the link] in :mod:`tidal_kv.slots`)."""
        b, h, d = self._shape
        kv = torch.empty(2, b, h, cap, d, dtype=self._dtype, device=self._device)  # [2, B, H, cap, D]
        return Slot(kv, device_chunk(self._stage_layout(cap), self._device) if self._quantized else None)

    def _stage_layout(self, cap: int) -> ChunkLayout:
        """The layout of a slot's staging buffer: ``cap`` tokens of pages in their stored format."""
        b, h, d = self._shape
        p = self._page_tokens
        return ChunkLayout(cap // p, b, h, p, d, self._dtype, self._storage)

    def _place(self, per_token: int) -> None:
        """Decide resident vs offloaded layers (records the decision)."""
        c = self.config
        budget = c.vram_budget
        if c.resident_layers == "auto" and budget is None and self._cuda:
            free, _ = torch.cuda.mem_get_info(self._device)
            budget = int(free * c.vram_fraction)
        page_store = self._bytes()[0]
        stage = page_store * (self._capacity // c.page_tokens) if self._quantized else 0
        sizes = LayerBytes(
            per_token * self._capacity, per_token * c.page_tokens, self._chunk_pages * page_store, stage
        )
        self._offloaded, note = place_layers(c, budget, sizes)
        self._resident = sorted(set(range(c.num_layers)) - set(self._offloaded))
        self._note(f"{note} (capacity {self._capacity} tokens, {sizes.layer / 2**20:.1f} MiB per layer)")

    def _ensure_host_pages(self, layer: int, pages: int) -> None:
        chunks = self._host[layer]
        while len(chunks) * self._chunk_pages < pages:
            chunks.append(self._pool.chunk(self._chunk_layout))

    def _grow(self, needed: int) -> None:
        """Reallocate device buffers for a sequence longer than the capacity (logged)."""
        p = self.config.page_tokens
        new_cap = -(-max(needed, 2 * self._capacity) // p) * p
        self._note(
            f"sequence of {needed} tokens exceeds the capacity of {self._capacity}: reallocating the device K/V "
            f"to {new_cap} tokens (pass a larger max_tokens to avoid this)",
            logging.WARNING,
        )
        self.stats.reallocations += 1
        for layer, kv_at in list(self._res_at.items()):
            nk, nv = self._empty_kv(new_cap)
            n = self._lengths[layer]
            KVRange(nk, nv).write(0, *kv_at.upto(n))  # [B, H, n, D] each
            self._set_resident(layer, nk, nv)
        if self._slots:
            self._sync_copies()  # why: queued gathers still write into the old slots
            self._slots = [self._new_slot(new_cap) for _ in self._slots]
            self._pending.clear()
            self._current = None
        self._capacity = new_cap

    # ------------------------------------------------------------------ resident layers

    def _update_resident(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # token ranges of the [B, H, cap, D] K and V buffers
        return self._res_at[layer].append(self._lengths[layer], k, v)

    # ------------------------------------------------------------------ offloaded layers

    def _update_offloaded(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, compute: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self._page_tokens
        s = self._lengths[layer]
        e = s + k.shape[2]
        full_old, full_new = s // p, e // p
        slot = self._pending.pop(layer, None)
        if slot is None:
            slot = pick_slot(self._slots, self._pending, self._current, layer, self.stats)
        elif slot.prefetched_pages:
            self.stats.prefetched += 1
        if slot.pages < full_old:
            # nothing (or not enough) was prefetched: copy the missing pages in now
            self.stats.gathered_on_demand += 1
            self._gather(layer, slot, full_old)
        self._current = slot
        if slot.ready is not None:
            wait(compute, slot.ready)  # why: the gathered pages must land before the slot is read or written
            slot.ready = None
        if slot.staged:
            self._finish(slot, compute)
        # the partial page and the new tokens meet in the slot; filled pages drain to the host, and what stays
        # partial goes back to the tail (a decode step's single token takes `_step_offloaded` instead)
        t_old = s - full_old * p
        tail = self._tails[layer].buf  # [2, B, H, P, D]
        if t_old:
            slot.k[:, :, full_old * p : s].copy_(tail[0, :, :, :t_old])
            slot.v[:, :, full_old * p : s].copy_(tail[1, :, :, :t_old])
        slot.k[:, :, s:e].copy_(k)
        slot.v[:, :, s:e].copy_(v)
        if full_new > full_old:
            self._flush(layer, slot, full_old, full_new)
        t_new = e - full_new * p
        if t_new:
            tail[0, :, :, :t_new].copy_(slot.k[:, :, full_new * p : e])
            tail[1, :, :, :t_new].copy_(slot.v[:, :, full_new * p : e])
        slot.pages = full_new
        return slot.k[:, :, :e], slot.v[:, :, :e]
