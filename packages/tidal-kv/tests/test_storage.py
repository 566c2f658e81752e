"""FP8 page format and host page allocation."""

from __future__ import annotations

import pytest
import torch

from tidal_kv.storage import FP8_DTYPE, ChunkLayout, HostPagePool, dequantize_fp8, quantize_fp8
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
