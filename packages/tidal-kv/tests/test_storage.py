"""FP8 and NF4 page formats and host page allocation."""

from __future__ import annotations

import pytest
import torch

import tidal_quant as tq
from tidal_kv.storage import (
    FP8_DTYPE,
    NF4_BLOCK,
    ChunkLayout,
    HostPagePool,
    balanced_chunk_pages,
    decode_pages,
    dequantize_fp8,
    encode_pages,
    quantize_fp8,
)
from tidal_testing import assert_sqnr


def test_fp8_round_trip_per_token_and_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g) * torch.logspace(-3, 3, 5).view(
        1, 1, 5, 1
    )  # rows of mixed scale
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (2, 3, 5, 1)
    y = dequantize_fp8(q, scale, torch.float32)
    for t in range(5):  # every row keeps its own relative precision
        assert_sqnr(y[:, :, t], x[:, :, t], 28.0)
    zero = torch.zeros(1, 1, 1, 8)
    assert torch.equal(dequantize_fp8(*quantize_fp8(zero), torch.float32), zero)


def test_host_pool_chunks_from_the_arena():
    pool = HostPagePool(pin=False)
    size = HostPagePool.chunk_bytes(ChunkLayout(3, 1, 2, 4, 8, torch.bfloat16))
    pool.reserve(2 * size)
    a = pool.chunk(ChunkLayout(3, 1, 2, 4, 8, torch.bfloat16))
    b = pool.chunk(ChunkLayout(3, 1, 2, 4, 8, torch.float16, "fp8"))
    # laid out like the device K/V, [2, B, H, C·P, D]: a page run is evenly spaced rows on both sides
    assert a.data.shape == (2, 1, 2, 3 * 4, 8) and a.scale is None
    assert b.data.dtype == FP8_DTYPE and b.scale.shape == (2, 1, 2, 3 * 4, 1)
    a.data.fill_(1.5)
    b.data.view(torch.uint8).fill_(7)
    assert a.data.float().sum().item() == 1.5 * a.data.numel()  # the two chunks do not overlap
    assert pool.nbytes == a.nbytes + b.nbytes
    pool.release()
    assert pool.nbytes == 0


def test_host_pool_refusal_names_the_fixes(monkeypatch):
    import tidal_kv.storage as storage
    from tidal_arena import ArenaConfig
    from tidal_kv import KVCacheError

    real = storage.ArenaConfig
    monkeypatch.setattr(storage, "ArenaConfig", lambda **kw: real(max_pinned_bytes=1 << 20, **kw))
    pool = HostPagePool(pin=False)
    assert isinstance(pool._arena.config, ArenaConfig)
    with pytest.raises(KVCacheError, match="resident_layers"):
        pool.reserve(4 << 20)


@pytest.mark.parametrize("dtype, row_bytes", [(torch.bfloat16, 72), (torch.float16, 72), (torch.float32, 80)])
def test_nf4_scales_are_kept_in_the_kv_dtype_without_changing_a_value(dtype, row_bytes):
    # a 128-wide row: 64 packed bytes + four absmax in the K/V dtype (fp32 scales would make bf16 rows 80)
    layout = ChunkLayout(1, 1, 1, 1, 128, dtype, "nf4")
    assert (
        layout.scale_dtype == dtype and layout.data_bytes + layout.scale_bytes == 2 * row_bytes
    )  # K and V rows
    x = (torch.randn(2, 1, 3, 16, 128, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    data, scales = encode_pages(x, "nf4")
    assert scales.dtype == dtype
    # the same decoded values as the fp32 absmax tidal-quant keeps for a weight: the absmax is one of x's values
    weight = tq.quantize(x.reshape(-1, 128), "nf4", block_size=NF4_BLOCK)
    assert torch.equal(scales.float().reshape(-1), weight.scales)
    want = tq.dequantize(weight, dtype).view(x.shape)
    assert torch.equal(decode_pages(data, scales, "nf4", dtype), want)
    pool = HostPagePool(pin=False)
    chunk = pool.chunk(layout)
    assert chunk.scale.dtype == dtype and chunk.nbytes == layout.data_bytes + layout.scale_bytes
    pool.release()


@pytest.mark.parametrize(
    ("pages", "most", "want"), [(17, 13, 9), (26, 13, 13), (16, 13, 8), (129, 227, 129), (5, 0, 1)]
)
def test_chunks_are_evenly_filled(pages, most, want):
    cp = balanced_chunk_pages(pages, most)
    assert cp == want
    chunks = -(-pages // cp)
    assert cp <= max(1, most) and chunks == -(
        -pages // max(1, min(pages, most))
    )  # no more chunks than needed
    assert chunks * cp - pages < chunks  # under one page of slack per chunk


def test_host_pages_of_a_capacity_just_past_a_chunk(monkeypatch):
    import tidal_kv.paged as paged_mod
    from tidal_kv import PagedKVCache

    # 17 pages of capacity, 13 per chunk at most: two chunks of 9 pages, not 13 + 13
    layout = ChunkLayout(1, 1, 2, 4, 8, torch.float32)
    monkeypatch.setattr(paged_mod, "_CHUNK_BYTES", 13 * (layout.data_bytes + layout.scale_bytes))
    cache = PagedKVCache(2, 17 * 4, resident_layers=1, page_tokens=4)
    cache.update(0, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    assert cache.memory()["host_bytes"] == 2 * 9 * layout.data_bytes
