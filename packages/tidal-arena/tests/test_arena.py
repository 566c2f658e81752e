import itertools
import logging
import random
import sys
import threading
import time

import pytest
import torch

from tidal_arena import (
    ArenaConfig,
    ArenaError,
    ArenaExhausted,
    PageLockLimitError,
    PinnedArena,
    arena_stats,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


# -- alignment and views ---------------------------------------------------------------------------
@pytest.mark.parametrize("alignment", [16, 512, 4096])
def test_blocks_are_aligned_and_disjoint(make_arena, alignment, rand_bytes):
    arena = make_arena(slab_bytes=256 * KiB, alignment=alignment)
    rng = random.Random(alignment)
    blocks = [arena.alloc(rng.randint(1, 5000), tag="t") for _ in range(40)]
    spans = []
    for b in blocks:
        assert b.data_ptr % alignment == 0
        assert b.offset % alignment == 0
        assert b.capacity % alignment == 0 and b.capacity >= b.nbytes
        spans.append((b.data_ptr, b.data_ptr + b.capacity))
    spans.sort()
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans)), "blocks overlap"
    # a float64 view works at any aligned offset and is zero-copy
    b = blocks[-1]
    n = b.nbytes // 8
    t = b.tensor(torch.float64, (n,))
    src = rand_bytes(n * 8, 7).view(torch.float64)
    t.copy_(src)
    assert t.data_ptr() == b.data_ptr
    assert torch.equal(b.tensor(torch.uint8)[: n * 8], src.view(torch.uint8))


def test_tensor_shape_and_dtype(make_arena):
    arena = make_arena(slab_bytes=64 * KiB)
    b = arena.alloc(6 * 8 * 2)
    t = b.tensor(torch.bfloat16, (6, 8))
    assert t.shape == (6, 8) and t.dtype == torch.bfloat16
    assert b.tensor(torch.int32).shape == (24,)
    assert b.tensor(torch.float32, 12).shape == (12,)
    with pytest.raises(ValueError, match=r"shape \(7, 8\).*needs 112 bytes but the block has 96"):
        b.tensor(torch.bfloat16, (7, 8))
    with pytest.raises(TypeError, match="dtype"):
        b.tensor("float32")  # type: ignore[arg-type]


# -- growth, reserve, exhaustion ------------------------------------------------------------------------
def test_growth_by_slab_and_exact_reserve(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=1 * MiB)
    arena.reserve(100_000)
    assert arena.stats().reserved_bytes == 100_352  # 100_000 rounded up to 512 only, not to 128 KiB
    a = arena.alloc(90_000)
    assert (arena.stats().slabs, a.slab) == (1, 0)
    arena.alloc(20_000)  # does not fit the 10 KiB left: a new slab of slab_bytes
    assert arena.stats().reserved_bytes == 100_352 + 64 * KiB
    big = arena.alloc(300_000)  # larger than slab_bytes: a slab of exactly the request
    assert arena.stats().reserved_bytes == 100_352 + 64 * KiB + 300_032
    assert big.slab == 2


def test_growth_is_clipped_to_the_cap(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=96 * KiB)
    arena.alloc(64 * KiB)
    arena.alloc(8 * KiB)  # only 32 KiB room left: the second slab takes what remains
    s = arena.stats()
    assert s.reserved_bytes == 96 * KiB and s.slabs == 2 and s.free_bytes == 24 * KiB


def test_reserve_beyond_cap_is_a_page_lock_limit_error(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=1 * MiB)
    arena.reserve(512 * KiB)
    with pytest.raises(
        PageLockLimitError, match=r"above the cap 1\.00 MiB \(1048576 B\) set by max_pinned_bytes"
    ):
        arena.reserve(600 * KiB)
    assert arena.stats().reserved_bytes == 512 * KiB


def test_exhaustion_error_states_requested_free_largest_and_fix(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=64 * KiB)
    blocks = [arena.alloc(8 * KiB, tag="w") for _ in range(8)]
    for b in blocks[::2]:
        b.free()  # 4 holes of 8 KiB: 32 KiB free, largest 8 KiB
    with pytest.raises(ArenaExhausted) as info:
        arena.alloc(16 * KiB, tag="big")
    msg = str(info.value)
    assert "cannot allocate 16.00 KiB (16384 B)" in msg
    assert "free 32.00 KiB (32768 B)" in msg
    assert "largest free block 8.00 KiB (8192 B)" in msg
    assert "cap 64.00 KiB (65536 B) set by max_pinned_bytes" in msg
    assert "Fix:" in msg and "max_pinned_bytes" in msg and "on_limit='pageable'" in msg
    assert isinstance(info.value, ArenaError)


def test_pageable_fallback_beyond_cap_is_counted_and_logged_once(make_arena, caplog):
    arena = make_arena(slab_bytes=16 * KiB, max_pinned_bytes=16 * KiB, on_limit="pageable")
    arena.alloc(16 * KiB)
    with caplog.at_level(logging.WARNING, logger="tidal_arena"):
        f1 = arena.alloc(3000, tag="spill")
        f2 = arena.alloc(5000, tag="spill")
    assert sum("pageable memory" in r.getMessage() for r in caplog.records) == 1
    s = arena.stats()
    assert (s.fallbacks, s.fallback_bytes, s.reserved_bytes) == (2, 3072 + 5120, 16 * KiB)
    assert s.by_tag["spill"] == 3072 + 5120
    assert not f1.pinned
    f1.tensor(torch.int16).copy_(torch.arange(1500, dtype=torch.int16))
    assert int(f1.tensor(torch.int16).sum()) == sum(range(1500))
    f1.free()
    f2.free()
    s = arena.stats()
    assert (s.fallbacks, s.fallback_bytes, s.blocks) == (2, 0, 1)


# -- free lists: best fit, coalescing, fragmentation --------------------------------------------------
def test_coalescing_and_fragmentation_numbers(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=64 * KiB)
    blocks = [arena.alloc(4 * KiB) for _ in range(16)]
    assert arena.stats().free_bytes == 0
    for b in blocks[::2]:
        b.free()
    s = arena.stats()
    assert (s.free_bytes, s.largest_free_block) == (32 * KiB, 4 * KiB)
    assert s.fragmentation == pytest.approx(1 - 4 / 32)
    # freeing block 1 merges holes 0, 1, 2 into one 12 KiB extent
    blocks[1].free()
    s = arena.stats()
    assert (s.free_bytes, s.largest_free_block) == (36 * KiB, 12 * KiB)
    assert s.fragmentation == pytest.approx(1 - 12 / 36)
    rest = blocks[3::2]
    random.Random(0).shuffle(rest)
    for b in rest:
        b.free()
    s = arena.stats()
    assert (s.free_bytes, s.largest_free_block, s.fragmentation) == (64 * KiB, 64 * KiB, 0.0)
    whole = arena.alloc(64 * KiB)  # fits without growing: the slab coalesced back into one extent
    assert (whole.offset, arena.stats().slabs) == (0, 1)


def test_best_fit_picks_the_smallest_hole(make_arena):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=64 * KiB)
    a = arena.alloc(8 * KiB)
    arena.alloc(4 * KiB)  # separator
    b = arena.alloc(4 * KiB)
    arena.alloc(4 * KiB)  # separator
    a.free()
    b.free()
    c = arena.alloc(3 * KiB)
    assert c.offset == b.offset  # the 4 KiB hole, not the 8 KiB one nor the tail
    d = arena.alloc(6 * KiB)
    assert d.offset == a.offset


# -- tags and aggregation -------------------------------------------------------------------------------
def test_tags_and_arena_stats_aggregate(make_arena):
    a1 = make_arena(slab_bytes=64 * KiB)
    a2 = make_arena(slab_bytes=32 * KiB)
    x = a1.alloc(1000, tag="grads")
    a1.alloc(2048, tag="moments")
    a2.alloc(100, tag="grads")
    assert a1.stats().by_tag == {"grads": 1024, "moments": 2048}
    total = arena_stats()
    assert total["arenas"] >= 2
    assert total["by_tag"]["grads"] >= 1024 + 512
    assert total["reserved_bytes"] >= 96 * KiB
    x.free()
    assert a1.stats().by_tag == {"moments": 2048}
    assert a1.stats().peak_used_bytes == 3072


# -- event-guarded reuse ---------------------------------------------------------------------------------
def test_block_freed_with_pending_event_is_not_reused(make_arena, manual_event):
    arena = make_arena(slab_bytes=64 * KiB, max_pinned_bytes=128 * KiB)
    a = arena.alloc(64 * KiB, tag="x")
    ev = manual_event()
    a.free(after=ev)
    s = arena.stats()
    assert (s.pending_bytes, s.free_bytes, s.used_bytes) == (64 * KiB, 0, 0)
    b = arena.alloc(64 * KiB)  # must not get a's memory while ev is pending: grows instead
    assert b.slab != a.slab
    with pytest.raises(ArenaExhausted, match=r"64\.00 KiB \(65536 B\) waiting for their copy's event"):
        arena.alloc(1)
    ev.set()
    c = arena.alloc(64 * KiB)
    assert (c.slab, c.offset) == (a.slab, a.offset)
    assert arena.stats().pending_bytes == 0


def test_reclaim_wait_polls_stand_in_events(make_arena, manual_event):
    arena = make_arena(slab_bytes=16 * KiB, max_pinned_bytes=16 * KiB)
    blk = arena.alloc(16 * KiB)
    ev = manual_event()
    blk.free(after=ev)
    assert arena.reclaim() == 0
    threading.Timer(0.05, ev.set).start()
    t0 = time.perf_counter()
    assert arena.reclaim(wait=True) == 16 * KiB
    assert time.perf_counter() - t0 >= 0.04
    assert arena.alloc(16 * KiB).offset == 0


# -- concurrency -------------------------------------------------------------------------------------------
def test_concurrent_alloc_free_keeps_live_blocks_intact(make_arena, rand_bytes, manual_event):
    arena = make_arena(slab_bytes=128 * KiB, max_pinned_bytes=2 * MiB, alignment=256)
    errors: list[str] = []
    live_all: list = []
    lock = threading.Lock()
    pending_events: list = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[tuple] = []
        for step in range(250):
            if live and (rng.random() < 0.45 or len(live) > 12):
                blk, data = live.pop(rng.randrange(len(live)))
                if not torch.equal(blk.tensor(torch.uint8), data):
                    errors.append(f"thread {seed}: block {blk} corrupted at step {step}")
                if rng.random() < 0.3:
                    ev = manual_event()
                    with lock:
                        pending_events.append(ev)
                    blk.free(after=ev)
                else:
                    blk.free()
            else:
                n = rng.randint(1, 20_000)
                blk = arena.alloc(n, tag=f"t{seed % 2}")
                data = rand_bytes(n, seed * 100_000 + step)
                blk.tensor(torch.uint8).copy_(data)
                live.append((blk, data))
            if rng.random() < 0.1:
                with lock:
                    for ev in pending_events[: len(pending_events) // 2]:
                        ev.set()
        with lock:
            live_all.extend(live)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often so that unguarded allocator state would race
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    for blk, data in live_all:
        assert torch.equal(blk.tensor(torch.uint8), data)
    spans = sorted((b.data_ptr, b.data_ptr + b.capacity) for b, _ in live_all)
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans)), "live blocks overlap"
    s = arena.stats()
    assert s.used_bytes == sum(b.capacity for b, _ in live_all)
    assert s.blocks == len(live_all)
    for ev in pending_events:
        ev.set()
    for b, _ in live_all:
        b.free()
    s = arena.stats()
    assert (s.used_bytes, s.pending_bytes, s.free_bytes) == (0, 0, s.reserved_bytes)
    assert s.largest_free_block == max(128 * KiB, s.largest_free_block)  # slabs coalesced back
    assert s.fragmentation == pytest.approx(1 - s.largest_free_block / s.free_bytes)


# -- bad arguments and lifetime -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda a: a.alloc(0), ValueError, "nbytes must be >= 1, got 0"),
        (lambda a: a.alloc(1.5), TypeError, "nbytes must be an int, got float"),
        (lambda a: a.alloc(True), TypeError, "nbytes must be an int"),
        (lambda a: a.alloc(10, tag=3), TypeError, "tag must be a str, got int"),
        (lambda a: a.reserve(-5), ValueError, "reserve: nbytes must be >= 1"),
        (lambda a: a.free("block"), ValueError, "block must be a Block of this arena"),
        (lambda a: a.free(a.alloc(10), after=object()), TypeError, r"after must have a query\(\)"),
    ],
)
def test_bad_arguments_name_the_option(make_arena, call, exc, match):
    with pytest.raises(exc, match=match):
        call(make_arena(slab_bytes=16 * KiB))


def test_bad_config_type_and_foreign_block_and_double_free(make_arena):
    with pytest.raises(TypeError, match="config must be an ArenaConfig"):
        PinnedArena({"backend": "pageable"})  # type: ignore[arg-type]
    a1, a2 = make_arena(slab_bytes=16 * KiB), make_arena(slab_bytes=16 * KiB)
    b = a1.alloc(100)
    with pytest.raises(ValueError, match="Block of this arena"):
        a2.free(b)
    b.free()
    with pytest.raises(ArenaError, match="double free"):
        b.free()
    with pytest.raises(ArenaError, match="was freed"):
        b.tensor()


def test_close_keeps_existing_views_valid_and_refuses_new_work(make_arena, rand_bytes):
    arena = make_arena(slab_bytes=16 * KiB)
    b = arena.alloc(4096)
    view = b.tensor(torch.uint8)
    data = rand_bytes(4096, 3)
    view.copy_(data)
    with arena:
        pass
    assert torch.equal(view, data)
    with pytest.raises(ArenaError, match="closed"):
        arena.alloc(1)
    b.free()  # freeing after close is allowed (accounting only)
    assert arena.stats().blocks == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_auto_falls_back_to_pageable_and_cupy_is_an_error_without_cuda(caplog):
    with PinnedArena(ArenaConfig(slab_bytes=4 * KiB)) as arena:
        assert (arena.backend, arena.pinned) == ("pageable", False)
        assert "CUDA" in arena.degraded_reason
        assert arena.stats().degraded_reason == arena.degraded_reason
        assert not arena.alloc(10).pinned
    with pytest.raises(ArenaError, match=r"backend='cupy' but torch sees no CUDA device.*Fix"):
        PinnedArena(ArenaConfig(backend="cupy"))


# -- GPU: the page-locked backend ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_blocks_are_pinned_per_torch(rand_bytes):
    with PinnedArena(ArenaConfig(backend="cupy", slab_bytes=8 * MiB)) as arena:
        assert arena.pinned and arena.backend == "cupy"
        b = arena.alloc(3 * MiB + 5, tag="w")
        t = b.tensor(torch.uint8)
        assert t.is_pinned() and b.pinned
        data = rand_bytes(b.nbytes, 11)
        t.copy_(data)
        dev = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()  # why: the copy must land before the bytes are compared
        assert torch.equal(dev.cpu(), data)
        s = arena.stats()
        assert (s.page_lock_calls, s.reserved_bytes) == (1, 8 * MiB)


@pytest.mark.gpu
@pytest.mark.parametrize("mib", [64, 256])
def test_gpu_arena_blocks_copy_as_fast_as_torch_pinned_memory(mib, rand_bytes, copy_gbps):
    """An arena block moves over the link at the speed of torch's own pinned memory, both ways.

    The reference is measured in the same rounds, so the check holds on any machine's link: a block
    that were not page-locked would go through the driver's staging buffers at a fraction of it.
    """
    n = mib * MiB
    with PinnedArena(ArenaConfig(backend="cupy", slab_bytes=n)) as arena:
        ours = arena.alloc(n).tensor(torch.uint8)
        ours.copy_(rand_bytes(n, mib))
        theirs = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        rates: dict[str, list[float]] = {k: [] for k in ("h2d", "h2d_ref", "d2h", "d2h_ref")}
        for _ in range(3):  # alternate the two sides, so drift in the link hits both alike
            rates["h2d"].append(copy_gbps(ours, dev))
            rates["h2d_ref"].append(copy_gbps(theirs, dev))
            rates["d2h"].append(copy_gbps(dev, ours))
            rates["d2h_ref"].append(copy_gbps(dev, theirs))
        med = {k: sorted(v)[1] for k, v in rates.items()}
        print(f"\narena {mib} MiB, GB/s (median of 3):", {k: round(v, 1) for k, v in med.items()})
        dev.fill_(7)
        ours.copy_(dev)
        assert torch.equal(ours[:4096], dev[:4096].cpu()) and int(ours[-1]) == 7
        for way in ("h2d", "d2h"):
            ratio = med[way] / med[f"{way}_ref"]
            assert ratio >= 0.9, f"{way} with an arena block: {med[way]:.1f} GB/s, {ratio:.2f}x torch pinned"


@pytest.mark.gpu
def test_gpu_reserving_1_5_gib_locks_1_5_not_2(mem_counters):
    import cupy

    want = 3 * GiB // 2
    torch.zeros(1, device="cuda")  # create the CUDA context first: it would add to the counters below
    cupy.cuda.runtime.freeHost(cupy.cuda.runtime.hostAlloc(4096, 0))
    arena = PinnedArena(ArenaConfig(backend="cupy", slab_bytes=64 * MiB, max_pinned_bytes=4 * GiB))
    before = mem_counters()
    arena.reserve(want)
    ours = {k: v - before[k] for k, v in mem_counters().items()}
    s = arena.stats()
    assert (s.reserved_bytes, s.page_lock_calls, s.slabs) == (want, 1, 1)
    base = arena.alloc(want).data_ptr
    for addr in (base, base + want - 1):  # the driver knows the whole range as page-locked host memory
        assert cupy.cuda.runtime.pointerGetAttributes(addr).type == 1  # cudaMemoryTypeHost
    # the same request through torch's pinned pool, for comparison (it rounds up to a power of two)
    before = mem_counters()
    ref = torch.empty(want, dtype=torch.uint8, pin_memory=True)
    theirs = {k: v - before[k] for k, v in mem_counters().items()}
    print(
        "\nreserve(1.5 GiB): accounting",
        s.reserved_bytes / GiB,
        "GiB; kernel deltas GiB ours",
        {k: round(v / GiB, 3) for k, v in ours.items()},
        "torch pin_memory",
        {k: round(v / GiB, 3) for k, v in theirs.items()},
    )
    measure = next((k for k in ("VmPin", "VmLck", "VmRSS", "meminfo_used") if ours[k] > GiB), None)
    assert measure is not None, f"no kernel counter saw the 1.5 GiB reservation: {ours}"
    assert 1.45 * GiB <= ours[measure] <= 1.6 * GiB, f"{measure} grew by {ours[measure] / GiB:.3f} GiB"
    del ref
    arena.close()


# -- model check: free extents and blocks tile every slab ----------------------------------------------------
def _check_tiling(arena: PinnedArena, live: list, pending: list) -> None:
    """Live blocks, parked blocks and free extents cover each slab exactly once; no two free extents touch."""
    for slab_index, starts in enumerate(arena._starts):
        slab_size = arena._slabs[slab_index].nbytes
        pieces = [(o, n, "free") for o, n in starts.items()]
        pieces += [(b.offset, b.capacity, "live") for b in live if b.slab == slab_index]
        pieces += [(b.offset, b.capacity, "parked") for b, _ in pending if b.slab == slab_index]
        pieces.sort()
        pos = 0
        for (o, n, kind), nxt in zip(pieces, [*pieces[1:], None]):
            assert o == pos, f"slab {slab_index}: gap or overlap at {pos} (next piece {kind} at {o})"
            pos = o + n
            if nxt is not None and kind == "free":
                assert nxt[2] != "free", f"slab {slab_index}: free extents at {o} and {nxt[0]} not coalesced"
        assert pos == slab_size


@pytest.mark.parametrize("seed", range(3))
def test_random_ops_keep_free_lists_exact(make_arena, manual_event, seed):
    rng = random.Random(seed)
    arena = make_arena(slab_bytes=32 * KiB, max_pinned_bytes=256 * KiB, alignment=128)
    live: list = []
    pending: list = []
    for _ in range(400):
        r = rng.random()
        if r < 0.5:
            try:
                live.append(arena.alloc(rng.choice([1, 100, 128, 1000, 4096, 9000, 40_000]), tag="m"))
            except ArenaExhausted:
                assert arena.stats().largest_free_block < 40_000 + 128
        elif r < 0.8 and live:
            b = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                ev = manual_event()
                b.free(after=ev)
                pending.append((b, ev))
            else:
                b.free()
        elif pending:
            b, ev = pending.pop(rng.randrange(len(pending)))
            ev.set()
            arena.reclaim()
        _check_tiling(arena, live, pending)
        s = arena.stats()
        assert s.used_bytes == sum(b.capacity for b in live)
        assert s.pending_bytes == sum(b.capacity for b, _ in pending)
