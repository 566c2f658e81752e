"""PagedKVCache against a plain concatenation reference: paging must be bit-exact (native storage)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_kv import KVCacheError, KVConfigError, PagedKVCache
from tidal_kv import paged as paged_mod
from tidal_kv import slots as slots_mod
from tidal_kv import transfers as transfers_mod
from tidal_kv.config import KVConfig
from tidal_kv.storage import ChunkLayout, decode_pages, encode_pages
from tidal_kv.streams import profiled
from tidal_testing import assert_sqnr, devices


def _drive(
    cache: PagedKVCache,
    steps: list[int],
    *,
    batch=2,
    heads=3,
    dim=8,
    device="cpu",
    dtype=torch.float32,
    seed=0,
):
    """Feed ``steps`` (new tokens per step) through every layer in stack order; compare with torch.cat."""
    g = torch.Generator().manual_seed(seed)
    ref_k = [None] * cache.num_layers
    ref_v = [None] * cache.num_layers
    for n in steps:
        for layer in range(cache.num_layers):
            k = torch.randn(batch, heads, n, dim, generator=g).to(device, dtype)  # [B, H, n, D]
            v = torch.randn(batch, heads, n, dim, generator=g).to(device, dtype)
            ref_k[layer] = k if ref_k[layer] is None else torch.cat([ref_k[layer], k], dim=2)
            ref_v[layer] = v if ref_v[layer] is None else torch.cat([ref_v[layer], v], dim=2)
            keys, values = cache.update(layer, k, v)
            # the returned views are only valid until the next update: compare now
            assert keys.shape == ref_k[layer].shape
            assert torch.equal(keys, ref_k[layer]), (layer, n)
            assert torch.equal(values, ref_v[layer]), (layer, n)
            assert cache.seq_length(layer) == ref_k[layer].shape[2]
    return ref_k, ref_v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("gather_stream", ["side", "compute"])
def test_paging_bit_exact_across_page_boundaries(device, slots, gather_stream):
    cache = PagedKVCache(
        8, 40, resident_layers=3, page_tokens=8, prefetch_slots=slots, gather_stream=gather_stream
    )
    # prefill 13 (one full page + 5), decode across several boundaries, a chunk landing exactly on one
    _drive(cache, [13, 1, 1, 1, 8, 3, 1, 1, 1, 1, 1], device=device)
    assert cache.offloaded_layers == [0, 2, 4, 5, 7]
    assert cache.resident_layers == [1, 3, 6]
    s = cache.stats
    assert s.pages_flushed == 5 * (32 // 8)
    assert s.d2h_bytes == s.pages_flushed * 2 * 2 * 3 * 8 * 8 * 4
    # every decode step after the prefill found its pages already queued
    assert s.prefetched > 0 and s.gathered_on_demand == 0
    assert s.pages_gathered > 0 and s.h2d_bytes > 0
    assert (s.inline_gathers > 0) == (gather_stream == "compute")


def test_auto_spreads_offloaded_layers_and_respects_budget(monkeypatch):
    per_layer = 2 * 1 * 2 * 32 * 4 * 4  # K+V, B=1, H=2, cap=32, D=4, fp32
    monkeypatch.setattr(paged_mod, "_CHUNK_BYTES", per_layer // 4)  # one-page staging chunks
    cache = PagedKVCache(8, 32, resident_layers="auto", page_tokens=8, vram_budget=6 * per_layer)
    _drive(cache, [9, 1, 1], batch=1, heads=2, dim=4)
    mem = cache.memory()
    assert mem["device_bytes"] <= 6 * per_layer
    assert 4 <= len(cache.offloaded_layers) < 8
    off = cache.offloaded_layers
    assert off != list(range(8 - len(off), 8)) or len(off) == 8  # spread, not a block at the end
    assert mem["device_bytes_saved"] > 0
    assert mem["host_pages"] == len(off) * (11 // 8)


def test_auto_on_cpu_without_budget_keeps_all_resident():
    cache = PagedKVCache(4, 16, page_tokens=4)
    _drive(cache, [5, 1])
    assert cache.offloaded_layers == []
    assert cache.stats.d2h_bytes == 0


def test_budget_too_small_raises_with_numbers():
    cache = PagedKVCache(4, 64, vram_budget=100, page_tokens=8)
    with pytest.raises(KVCacheError, match="vram_budget=100"):
        cache.update(0, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))


def test_growth_past_max_tokens_is_logged_and_exact(caplog):
    cache = PagedKVCache(4, 16, resident_layers=[0, 3], page_tokens=4)
    with caplog.at_level(logging.WARNING, logger="tidal_kv.paged"):
        _drive(cache, [10, 5, 1, 1, 12, 1])
    assert cache.capacity >= 30
    assert cache.stats.reallocations >= 1
    assert any("exceeds the capacity" in r.message for r in caplog.records)


def test_reset_then_reuse_and_new_batch_shape():
    cache = PagedKVCache(4, 16, resident_layers=2, page_tokens=4)
    _drive(cache, [9, 1, 1], seed=1)
    cache.reset()
    assert all(cache.seq_length(i) == 0 for i in range(4))
    _drive(cache, [6, 1, 1, 1], seed=2)  # same shapes: buffers reused
    assert cache.stats.reallocations == 0
    cache.reset()
    _drive(cache, [5, 1], batch=3, seed=3)  # new batch size after reset: reallocated
    assert cache.stats.reallocations == 1


def test_multiple_chunks_per_layer(monkeypatch):
    # small chunks force several host chunks and several staging copies per gather and flush
    monkeypatch.setattr(paged_mod, "_CHUNK_BYTES", 2 * 2 * 2 * 4 * 4 * 4 * 2)  # two pages
    cache = PagedKVCache(3, 40, resident_layers=[1], page_tokens=4)
    _drive(cache, [17, 1, 1, 1, 9, 1])
    assert cache.stats.pages_flushed == 2 * (30 // 4)


def test_out_of_order_updates_still_exact():
    # not the stack order a model uses: the cache takes back prefetched slots and stays exact
    cache = PagedKVCache(4, 32, resident_layers=0, page_tokens=4)
    g = torch.Generator().manual_seed(0)
    ref = {}
    for layer in [0, 2, 1, 3, 3, 0, 1, 2, 2, 2, 0]:
        k = torch.randn(1, 2, 3, 4, generator=g)
        ref[layer] = k if layer not in ref else torch.cat([ref[layer], k], dim=2)
        keys, values = cache.update(layer, k, k + 1)
        assert torch.equal(keys, ref[layer]) and torch.equal(values, ref[layer] + 1)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("storage", ["native", "fp8", "nf4"])
def test_decode_reuses_cached_gather_views_and_stays_exact(device, storage, monkeypatch):
    """Two-page chunks: gathers span several runs; the views of a gather are built once per page range.

    Native pages are bit-exact; quantized pages are exactly what encode_pages + decode_pages make of each
    token (the scales cover parts of one (token, head) row, so that does not depend on where the pages were
    cut), whichever slot serves the layer and however many runs and chunks its gather took.
    """
    d = 32 if storage == "nf4" else 8  # nf4: whole 32-element blocks per row
    rows = 2 * 2 * 3 * 4  # (K/V, B, H, P) rows of one page
    # page bytes: fp32; e4m3 + one fp32 scale per row; packed NF4 + one fp32 scale per 32-element row
    by_storage = {"native": rows * d * 4, "fp8": rows * d + rows * 4, "nf4": rows * d // 2 + rows * 4}
    page = ChunkLayout(1, 2, 3, 4, d, torch.float32, storage)
    assert page.data_bytes + page.scale_bytes == by_storage[storage]
    monkeypatch.setattr(paged_mod, "_CHUNK_BYTES", 2 * by_storage[storage])
    cache = PagedKVCache(6, 24, resident_layers=2, page_tokens=4, prefetch_slots=2, storage=storage)
    g = torch.Generator().manual_seed(4)
    ref: dict[int, torch.Tensor] = {}

    def expected(kv: torch.Tensor) -> torch.Tensor:  # [2, B, H, T, D] as the cache returns it
        if storage == "native":
            return kv
        full = kv.shape[3] // 4 * 4
        paged = decode_pages(*encode_pages(kv[:, :, :, :full], storage), storage, kv.dtype)
        return torch.cat([paged, kv[:, :, :, full:]], dim=3)

    def step(n: int) -> None:  # n new tokens through every layer, checked against torch.cat
        for layer in range(6):
            kv = torch.randn(2, 2, 3, n, d, generator=g).to(device)  # [2, B, H, n, D]
            ref[layer] = kv if layer not in ref else torch.cat([ref[layer], kv], dim=3)
            keys, values = cache.update(layer, kv[0], kv[1])
            want = expected(ref[layer]) if layer in cache.offloaded_layers else ref[layer]
            assert torch.equal(keys, want[0]) and torch.equal(values, want[1])

    def plans():
        return {(id(s), layer): plan for s in cache._slots for layer, plan in s.plans.items()}

    step(13)  # 3 full pages + 1 token in the tail
    assert any(len(plan.runs) == 2 for plan in plans().values())  # pages 0-1 and page 2: two runs per gather
    step(1)  # 14 tokens: the same 3 pages are gathered
    mid = plans()
    step(1)  # 15 tokens: the same 3 pages again
    after = plans()
    assert any(after[key] is mid[key] for key in mid if key in after), "decode must reuse the gather views"
    for n in [1, 1, 1, 2, 1, 12, 1, 1]:  # page fills, then past max_tokens (slots reallocated)
        step(n)
    assert cache.stats.reallocations == 1
    cache.reset()
    ref.clear()
    for n in [6, 1, 1, 1, 1]:  # a new sequence in the same buffers
        step(n)


def test_decode_step_issues_one_record_and_one_wait_per_stream_per_offloaded_layer(monkeypatch):
    # the CUDA stream/event protocol, simulated on the CPU with stand-in streams and events
    calls: list[tuple[str, str]] = []

    def record(stream, event=None):
        calls.append(("record", stream))
        return event if event is not None else object()

    def wait(stream, event):
        if stream is not None and event is not None:
            calls.append(("wait", stream))

    for mod in (paged_mod, transfers_mod):  # the update path, and the page traffic's own module
        monkeypatch.setattr(mod, "record", record)
        monkeypatch.setattr(mod, "wait", wait)
    for mod in (transfers_mod, slots_mod):  # flushes' and gathers' stream contexts
        monkeypatch.setattr(mod, "on", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(transfers_mod, "synchronize", lambda *streams: None)
    materialize = PagedKVCache._materialize

    def fake_cuda(self, k):
        materialize(self, k)
        self._cuda, self._h2d, self._d2h = True, "h2d", "d2h"
        self._current_stream = lambda: "compute"

    monkeypatch.setattr(PagedKVCache, "_materialize", fake_cuda)
    cache = PagedKVCache(6, 128, resident_layers=3, page_tokens=64, prefetch_slots=2)
    k0 = torch.randn(2, 2, 70, 16)
    for layer in range(6):
        cache.update(layer, k0, k0)  # one page per offloaded layer flushed on the "D2H stream"
    assert ("record", "d2h") in calls
    one = torch.randn(2, 2, 1, 16)
    for layer in range(6):  # token 71: the first gathers after the flush also wait for it (once)
        cache.update(layer, one, one)
    calls.clear()
    steps = 4  # tokens 72..75: no page fills
    for _ in range(steps):
        for layer in range(6):
            cache.update(layer, one, one)
    n = steps * len(cache.offloaded_layers)
    assert sorted(calls) == sorted(
        [("record", "compute")] * n
        + [("record", "h2d")] * n
        + [("wait", "compute")] * n
        + [("wait", "h2d")] * n
    )
    cache._cuda, cache._h2d, cache._d2h = False, None, None  # back to the real CPU cache
    k, _ = cache.gather(cache.offloaded_layers[0])
    assert torch.equal(k, torch.cat([k0, one.expand(2, 2, 5, 16)], dim=2))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("storage", "min_db", "row_bytes"), [("fp8", 25.0, 32 + 4), ("nf4", 19.0, 16 + 2)])
def test_quantized_storage_is_close(device, storage, min_db, row_bytes):
    """Full pages go through the format (e4m3: ~32 dB on normal data; NF4, 4 bits: ~21 dB), the tail does not;
    a page reads the same whether its layer's slot was kept or refilled from the host."""
    cache = PagedKVCache(2, 32, resident_layers=0, page_tokens=4, storage=storage)
    g = torch.Generator().manual_seed(0)
    k0 = torch.randn(1, 2, 18, 32, generator=g).to(device, torch.bfloat16)
    cache.update(0, k0, -k0)
    cache.update(1, k0, k0)
    k1 = torch.randn(1, 2, 1, 32, generator=g).to(device, torch.bfloat16)
    keys, values = cache.update(0, k1, -k1)
    ref = torch.cat([k0, k1], dim=2)
    assert torch.equal(keys[:, :, 16:], ref[:, :, 16:])  # the device tail is exact
    assert not torch.equal(keys[:, :, :16], ref[:, :, :16])  # full pages went through the format
    # the same values whether the layer's slot was kept or refilled from the host
    again = PagedKVCache(3, 32, resident_layers=0, page_tokens=4, storage=storage, prefetch_slots=2)
    for layer in (0, 1, 2):
        again.update(layer, k0, -k0)
    k_refilled, _ = again.update(0, k1, -k1)  # layer 0's slot went to layer 2: refilled from the host
    assert again.stats.pages_gathered > 0
    assert torch.equal(k_refilled, keys)
    assert_sqnr(keys.float().cpu(), ref.float().cpu(), min_db)
    assert_sqnr(values.float().cpu(), -ref.float().cpu(), min_db)
    # (K/V, B, H, P) rows of a page; 32-element rows: e4m3 32 B + an fp32 scale, or NF4 16 B + a bf16 absmax
    rows = 2 * 1 * 2 * 4
    assert cache.stats.d2h_bytes == 2 * 4 * rows * row_bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, "num_layers=0"),
        ({"max_tokens": -1}, "max_tokens=-1"),
        ({"page_tokens": 0}, "page_tokens=0"),
        ({"storage": "int4"}, "storage='int4'"),
        ({"resident_layers": "most"}, "resident_layers='most'"),
        ({"resident_layers": 9}, "resident_layers=9"),
        ({"resident_layers": [0, 0]}, "resident_layers=\\[0, 0\\]"),
        ({"resident_layers": [7]}, "resident_layers=\\[7\\]"),
        ({"vram_fraction": 1.5}, "vram_fraction=1.5"),
        ({"vram_budget": 0}, "vram_budget=0"),
        ({"dtype": torch.int8}, r"dtype=torch\.int8"),
        ({"dtype": torch.float8_e4m3fn}, 'storage="fp8"'),
        ({"prefetch_slots": 4}, "prefetch_slots=4"),
        ({"device": "gpu0"}, "device='gpu0'"),
        ({"num_kv_heads": 2.5}, "num_kv_heads=2.5"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"num_layers": 4, "max_tokens": 16, **kwargs}
    with pytest.raises(KVConfigError, match=match):
        PagedKVCache(args.pop("num_layers"), args.pop("max_tokens"), **args)


def test_nf4_pages_need_whole_blocks_per_head_row():
    match = 'storage="nf4" is not accepted with head_dim=48'
    with pytest.raises(KVConfigError, match=match):
        KVConfig(num_layers=4, max_tokens=32, head_dim=48, storage="nf4")
    cache = PagedKVCache(4, 32, resident_layers=2, storage="nf4")
    with pytest.raises(KVConfigError, match=match):  # told by the first update when not configured
        cache.update(0, torch.randn(1, 2, 3, 48), torch.randn(1, 2, 3, 48))
    KVConfig(num_layers=4, max_tokens=32, head_dim=96, storage="nf4")  # three blocks per row


def test_bad_updates():
    cache = PagedKVCache(2, 16, num_kv_heads=2, dtype=torch.float32)
    k = torch.randn(1, 2, 3, 4)
    with pytest.raises(KVConfigError, match="layer=2"):
        cache.update(2, k, k)
    with pytest.raises(KVConfigError, match="num_kv_heads=3"):
        cache.update(0, torch.randn(1, 3, 3, 4), torch.randn(1, 3, 3, 4))
    with pytest.raises(KVConfigError, match=r"dtype=torch\.float32"):
        cache.update(0, k.double(), k.double())
    with pytest.raises(KVConfigError, match="does not match k"):
        cache.update(0, k, k[:, :, :2])
    with pytest.raises(KVConfigError, match="expected a tensor"):
        cache.update(0, k[0], k[0])
    cache.update(0, k, k)
    with pytest.raises(KVConfigError, match="call reset"):
        cache.update(0, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))


def test_gather_returns_copies_of_every_layer():
    cache = PagedKVCache(4, 16, resident_layers=2, page_tokens=4)
    ref_k, ref_v = _drive(cache, [9, 1, 1])
    for layer in range(4):
        k, v = cache.gather(layer)
        assert torch.equal(k, ref_k[layer]) and torch.equal(v, ref_v[layer])


@pytest.mark.gpu
def test_cuda_host_pages_are_pinned_and_gathers_run_on_a_side_stream():
    cache = PagedKVCache(6, 64, resident_layers=2, page_tokens=8, device="cuda")
    _drive(cache, [20, 1, 1, 1, 1, 1], device="cuda")
    chunk = cache._host[cache.offloaded_layers[0]][0]
    assert chunk.data.is_pinned(), cache.stats.events
    assert cache._h2d is not None and cache._h2d != torch.cuda.current_stream()
    assert cache.stats.prefetched == 5 * len(
        cache.offloaded_layers
    )  # every decode step, every offloaded layer
    assert cache.stats.gathered_on_demand == 0


def test_memory_report_accounts_for_every_buffer():
    cache = PagedKVCache(6, 32, resident_layers=2, page_tokens=8)
    _drive(cache, [17, 1], batch=1, heads=2, dim=4)
    mem = cache.memory()
    per_layer = 2 * 1 * 2 * 32 * 4 * 4  # K+V at capacity 32, fp32
    tails = 4 * 2 * 1 * 2 * 8 * 4 * 4
    staging = 4 * 2 * 1 * 2 * 8 * 4 * 4  # one chunk of the 4 pages of the capacity, for the flushes
    assert mem["device_bytes"] == 2 * per_layer + 2 * per_layer + tails + staging
    # fp8 pages are also staged on the way in (e4m3 data + fp32 scales per row), to be dequantized there:
    # each slot has a staging buffer for the capacity's pages (here 4, as many as the flush chunk holds)
    fp8 = PagedKVCache(6, 32, resident_layers=2, page_tokens=8, storage="fp8")
    for n in (17, 1):
        for layer in range(6):
            fp8.update(layer, torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))
    fp8_chunk = 4 * 2 * 1 * 2 * 8 * (4 * 1 + 4)
    slot_stages = 2 * fp8_chunk
    assert fp8.memory()["device_bytes"] == 2 * per_layer + 2 * per_layer + tails + fp8_chunk + slot_stages
    # nf4 (head_dim 32): 16 packed bytes + one fp32 scale per row; fp32 K/V, 8x the bytes per element above
    nf4 = PagedKVCache(6, 32, resident_layers=2, page_tokens=8, storage="nf4")
    for n in (17, 1):
        for layer in range(6):
            nf4.update(layer, torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32))
    nf4_chunk = 4 * 2 * 1 * 2 * 8 * (16 + 4)  # staged like fp8's: the flush chunk and one per slot
    assert nf4.memory()["device_bytes"] == 8 * (2 * per_layer + 2 * per_layer + tails) + 3 * nf4_chunk
    assert nf4.memory()["host_bytes"] == 4 * nf4_chunk
    assert mem["host_bytes"] == 4 * per_layer
    assert mem["host_pages"] == 4 * 2
    assert mem["all_resident_device_bytes"] == 6 * per_layer
    assert mem["tokens"] == 18


def test_device_option_must_match_updates():
    cache = PagedKVCache(2, 16, device="cpu")
    k = torch.randn(1, 2, 3, 4)
    cache.update(0, k, k)  # "cpu" matches tensors on cpu
    if torch.cuda.is_available():
        with pytest.raises(KVConfigError, match="device='cpu'"):
            cache.update(1, k.cuda(), k.cuda())


def test_bad_updates_after_the_first_are_still_refused():
    # the decode fast path must accept only exact matches; anything else takes the full checks
    cache = PagedKVCache(2, 16, resident_layers=1, page_tokens=4)
    k = torch.randn(1, 2, 3, 4)
    cache.update(0, k, k)
    with pytest.raises(KVConfigError, match="does not match k"):
        cache.update(1, k, k[:, :, :2])
    with pytest.raises(KVConfigError, match="0 new tokens"):
        cache.update(1, k[:, :, :0], k[:, :, :0])
    with pytest.raises(KVConfigError, match="expected a tensor"):
        cache.update(1, k[0], k[0])
    with pytest.raises(KVConfigError, match="call reset"):
        cache.update(1, k.double(), k.double())
    with pytest.raises(KVConfigError, match="call reset"):
        cache.update(1, torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 5))
    cache.update(1, k, k)  # and the right shape still goes through
    assert cache.seq_length(1) == 3


def test_profiler_ranges_appear_only_while_profiling():
    cache = PagedKVCache(6, 32, resident_layers=2, page_tokens=4)  # 4 offloaded layers share 2 slots
    _drive(cache, [9, 1])
    one = torch.randn(2, 3, 1, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for layer in range(6):
            cache.update(layer, one, one)
    names = {e.name for e in prof.events()}
    assert {"tidal::kv_update", "tidal::kv_gather"} <= names  # prefetches are gathers: one range
    assert isinstance(profiled("tidal::kv_update"), contextlib.nullcontext)  # no profiler: no range cost


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["native", "fp8", "nf4"])
@pytest.mark.parametrize("gather_stream", ["side", "compute"])
def test_cuda_decode_steps_allocate_nothing_and_create_no_events(monkeypatch, storage, gather_stream):
    """Native pages land in the slot in one strided copy; quantized pages dequantize from staging in place;
    on either stream (on the compute stream, graphs captured on the side stream replay in compute order)."""
    cache = PagedKVCache(
        6, 128, resident_layers=3, page_tokens=64, device="cuda", storage=storage, gather_stream=gather_stream
    )
    k0 = torch.randn(2, 2, 70, 32, device="cuda")
    for layer in range(6):
        cache.update(layer, k0, k0)
    one = torch.randn(2, 2, 1, 32, device="cuda")
    for layer in range(6):  # one step so every slot and event exists
        cache.update(layer, one, one)
    torch.cuda.synchronize()
    made = []
    real_event = torch.cuda.Event
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: made.append(1) or real_event(*a, **kw))
    before = (torch.cuda.memory_allocated(), cache.memory()["host_bytes"], cache.stats.gathered_on_demand)
    for _ in range(8):  # tokens 72..79: no page fills, so no D2H flush
        for layer in range(6):
            cache.update(layer, one, one)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), cache.memory()["host_bytes"], cache.stats.gathered_on_demand)
    assert before == after
    assert made == []
    # [Note: gather graphs]: quantized gathers (two copies and a decode) are replayed as graphs, native ones
    # (one copy) are not; the checks below read what the replays wrote
    graphs = [plan.graph is not None for slot in cache._slots for plan in slot.plans.values()]
    assert any(graphs) == (storage != "native"), graphs
    assert (cache.stats.inline_gathers > 0) == (gather_stream == "compute")
    ref = torch.cat([k0, one.expand(2, 2, 9, 32)], dim=2)
    exact = 0 if storage == "native" else 64  # the first page went through the format, the tail did not
    for layer in range(6):
        k, v = cache.gather(layer)
        assert torch.equal(k[:, :, exact:], ref[:, :, exact:]) and torch.equal(
            v[:, :, exact:], ref[:, :, exact:]
        )
        if exact:
            assert_sqnr(
                k[:, :, :exact].float().cpu(),
                ref[:, :, :exact].float().cpu(),
                {"fp8": 25.0, "nf4": 19.0}[storage],
            )


@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["native", "nf4"])
def test_cuda_auto_gather_stream_takes_the_compute_stream_at_batch_1_and_stays_exact(storage):
    """A tiny batch-1 decode gathers far under INLINE_BELOW of its step on the link: "auto" moves its gathers
    to the compute stream after one window, and every step returns what a side-stream cache returns; at
    batch 2 it never moves."""
    from tidal_kv.policy import WINDOW

    g = torch.Generator().manual_seed(0)
    for batch in (1, 2):
        caches = {
            mode: PagedKVCache(
                6, 256, resident_layers=3, page_tokens=64, device="cuda", storage=storage, gather_stream=mode
            )
            for mode in ("auto", "side")
        }
        k0 = torch.randn(batch, 2, 150, 32, generator=g).to("cuda")
        for cache in caches.values():
            for layer in range(6):
                cache.update(layer, k0, -k0)
        for _ in range(WINDOW + 4):
            one = torch.randn(batch, 2, 1, 32, generator=g).to("cuda")
            for layer in range(6):
                got = [tuple(t.clone() for t in c.update(layer, one, -one)) for c in caches.values()]
                assert all(torch.equal(a, b) for a, b in zip(*got, strict=True)), (batch, layer)
        stats = caches["auto"].stats
        if batch == 1:
            assert stats.gather_stream_switches == 1 and stats.inline_gathers > 0
        else:
            assert stats.gather_stream_switches == 0 and stats.inline_gathers == 0


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="a cache on a GPU that is not the current one needs two"
)
@pytest.mark.parametrize("storage", ["native", "nf4"])
def test_cuda_cache_on_a_gpu_that_is_not_the_current_one(storage):
    """A model on cuda:1 while cuda:0 is current: page copies and gather graphs act on the cache's device, and
    every step returns what the same cache on cuda:0 returns."""
    assert torch.cuda.current_device() == 0
    steps = {}
    for dev in ("cuda:0", "cuda:1"):
        cache = PagedKVCache(6, 256, resident_layers=3, page_tokens=64, device=dev, storage=storage)
        g = torch.Generator().manual_seed(0)
        k0 = torch.randn(2, 2, 150, 32, generator=g).to(dev)
        for layer in range(6):
            cache.update(layer, k0, -k0)
        out = []
        for _ in range(6):  # the same two full pages each step: gathers are replayed from the second on
            one = torch.randn(2, 2, 1, 32, generator=g).to(dev)
            for layer in range(6):
                k, v = cache.update(layer, one, -one)
                out.append((k.cpu(), v.cpu()))  # a slot view is valid until the next update: read it now
        steps[dev] = out
        graphs = [plan.graph is not None for slot in cache._slots for plan in slot.plans.values()]
        assert any(graphs) == (storage != "native"), graphs
    assert torch.cuda.current_device() == 0
    for (k0_, v0_), (k1_, v1_) in zip(steps["cuda:0"], steps["cuda:1"], strict=True):
        assert torch.equal(k0_, k1_) and torch.equal(v0_, v1_)


def test_kv_that_require_grad_are_refused_in_grad_mode():
    """The cache cannot carry autograd history: with grad mode on, K/V that require grad get a clear error
    (not an autograd error from deep inside a slot write); under no_grad the same tensors are cached."""
    cache = PagedKVCache(2, 16, resident_layers=1, page_tokens=4)
    w = torch.randn(4, 4, requires_grad=True)
    k = torch.randn(1, 2, 3, 4) @ w  # [1, 2, 3, 4], requires grad
    for layer in (0, 1):  # resident and offloaded
        with pytest.raises(KVConfigError, match=r"require grad.*torch\.no_grad\(\)"):
            cache.update(layer, k, k)
    with torch.no_grad():
        for layer in (0, 1):
            cache.update(layer, k, k)
    cache.update(0, k.detach(), k.detach())
    assert cache.seq_length(0) == 6 and torch.equal(cache.gather(1)[0], k.detach())


def test_decode_tokens_take_the_flat_path_and_filling_a_page_the_general_one(monkeypatch):
    # [Note: decode host path]: the flat path must serve exactly the steady decode tokens
    cache = PagedKVCache(4, 64, resident_layers=2, page_tokens=8)
    general: list[tuple[int, int]] = []
    real = PagedKVCache._update

    def counted(self, layer, k, v):
        general.append((layer, self.seq_length(layer)))
        return real(self, layer, k, v)

    monkeypatch.setattr(PagedKVCache, "_update", counted)
    ref = {layer: torch.randn(1, 2, 5, 4) for layer in range(4)}
    for layer in range(4):
        cache.update(layer, ref[layer], ref[layer])  # the prefill: general
    for _ in range(5):  # tokens 6..10: the 8th fills page 0
        for layer in range(4):
            one = torch.randn(1, 2, 1, 4)
            k, v = cache.update(layer, one, one)
            ref[layer] = torch.cat([ref[layer], one], dim=2)
            assert torch.equal(k, ref[layer]) and torch.equal(v, ref[layer])
    off = cache.offloaded_layers
    assert general == [(layer, 0) for layer in range(4)] + [(layer, 7) for layer in off]


@pytest.mark.parametrize("storage", ["native", "fp8", "nf4"])
@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(2, 5),
    page=st.integers(1, 4),
    slots=st.sampled_from([2, 3]),
    schedule=st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 2, 5]), st.booleans(), st.integers(0, 9), st.booleans()),
        min_size=1,
        max_size=14,
    ),
    data=st.data(),
)
def test_any_schedule_of_updates_matches_concatenation(storage, layers, page, slots, schedule, data):
    # the flat decode path and the general one, interleaved by any mix of token counts, page sizes, slot
    # counts, stack orders (a step's layers rotated), resets and gather streams, against torch.cat; an offloaded layer's
    # tokens in full pages come back as their page format makes them (each row's own scales: independent
    # of where pages were cut or which slot served them), the partial page's exactly
    resident = data.draw(st.integers(0, layers - 1), label="resident")
    cache = PagedKVCache(
        layers, 6, resident_layers=resident, page_tokens=page, prefetch_slots=slots, storage=storage
    )
    d = 32 if storage == "nf4" else 4  # nf4: whole 32-element blocks per row
    g = torch.Generator().manual_seed(len(schedule))
    ref: dict[int, torch.Tensor] = {}

    def expected(layer: int) -> torch.Tensor:  # [2, B, H, T, D] as the cache returns it
        kv = ref[layer]
        full = kv.shape[3] // page * page
        if storage == "native" or layer not in cache.offloaded_layers or not full:
            return kv
        paged = decode_pages(*encode_pages(kv[:, :, :, :full], storage), storage, kv.dtype)
        return torch.cat([paged, kv[:, :, :, full:]], dim=3)

    for n, reset, rotate, switch in schedule:
        if switch:  # gathers move between the side and the compute stream, as "auto" may decide
            cache._set_inline(not cache._inline)
        if reset:
            cache.reset()
            ref.clear()
        order = list(range(layers))
        order = order[rotate % layers :] + order[: rotate % layers]
        for layer in order:
            kv = torch.randn(2, 1, 2, n, d, generator=g)  # K and V, [B, H, n, D] each
            ref[layer] = torch.cat([ref[layer], kv], dim=3) if layer in ref else kv
            k, v = cache.update(layer, kv[0], kv[1])
            want = expected(layer)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), (layer, n)
    for layer in ref:
        k, v = cache.gather(layer)
        want = expected(layer)
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])


@pytest.mark.parametrize("storage", ["fp8", "nf4"])
def test_quantized_pages_are_dequantized_by_their_own_layers_update(storage):
    """[Note: dequantization off the link]: a prefetch only copies a layer's stored pages into the slot's
    staging; the layer's update dequantizes them (with its partial page) before attention reads the slot."""
    d = 32
    cache = PagedKVCache(6, 64, resident_layers=[0, 2, 4], page_tokens=8, storage=storage)
    g = torch.Generator().manual_seed(0)
    ref = {}
    for n in (20, 1, 1):  # a prefill of 2 full pages + 4 tokens, then decode steps
        for layer in range(6):
            kv = torch.randn(2, 1, 2, n, d, generator=g)  # [2, B, H, n, D]
            ref[layer] = kv if layer not in ref else torch.cat([ref[layer], kv], dim=3)
            slot = cache._pending.get(layer)
            if n == 1 and layer in cache.offloaded_layers:
                # three offloaded layers share two slots: the prefetch staged this layer's pages over
                # another layer's K/V, and nothing has dequantized them yet
                assert slot is not None and [p.key for p in slot.staged] == [(0, 2)]
                pages = decode_pages(*encode_pages(ref[layer][:, :, :, :16], storage), storage, kv.dtype)
                assert not torch.equal(slot.kv[:, :, :, :16], pages)
            keys, values = cache.update(layer, kv[0], kv[1])
            if layer in cache.offloaded_layers:
                assert not slot.staged if slot is not None else True
                full = ref[layer].shape[3] // 8 * 8
                pages = decode_pages(*encode_pages(ref[layer][:, :, :, :full], storage), storage, kv.dtype)
                want = torch.cat([pages, ref[layer][:, :, :, full:]], dim=3)
            else:
                want = ref[layer]
            assert torch.equal(keys, want[0]) and torch.equal(values, want[1]), (n, layer)
    slot = cache._slots[0]
    slot.staged.append(slot.plans[slot.owner])
    slot.take(5 if slot.owner != 5 else 3)  # another layer's staged pages are dropped with the slot
    assert slot.staged == [] and slot.pages == 0


@pytest.mark.parametrize("storage", ["native", "fp8", "nf4"])
def test_auto_placement_fits_the_budget_with_every_staging_buffer_counted(storage):
    """Whatever the budget, "auto" placement's device bytes (resident layers, slots and their staging, partial
    pages, the flush chunk) stay within it, for every page format."""
    per_layer = 2 * 1 * 2 * 32 * 32 * 4  # K+V, B=1, H=2, cap=32, D=32, fp32
    fitted = 0
    for budget in range(3 * per_layer, 8 * per_layer, per_layer // 8):
        cache = PagedKVCache(8, 32, page_tokens=8, vram_budget=budget, storage=storage)
        try:
            _drive(cache, [9, 1], batch=1, heads=2, dim=32) if storage == "native" else _fill(cache, 32)
        except KVCacheError:
            continue  # too small for any placement: refused with numbers (test_budget_too_small_...)
        assert cache.memory()["device_bytes"] <= budget, (budget, cache.offloaded_layers)
        fitted += 1
    assert fitted > 20


def _fill(cache: PagedKVCache, dim: int) -> None:
    """A prefill and a decode token through every layer (lossy formats: no comparison with torch.cat)."""
    g = torch.Generator().manual_seed(0)
    for n in (9, 1):
        for layer in range(cache.num_layers):
            cache.update(
                layer, torch.randn(1, 2, n, dim, generator=g), torch.randn(1, 2, n, dim, generator=g)
            )
