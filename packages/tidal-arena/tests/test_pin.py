import time

import pytest
import torch

from tidal_arena import ArenaError, arena_stats, is_registered, pin_, unpin_

GiB = 1 << 30


@pytest.mark.parametrize(
    "arg, exc, match",
    [
        ([1, 2, 3], TypeError, "pin_: tensor must be a torch.Tensor, got list"),
        (torch.empty(4, device="meta"), ValueError, "pin_: tensor must be on the CPU, got device meta"),
    ],
)
def test_pin_bad_arguments(arg, exc, match):
    with pytest.raises(exc, match=match):
        pin_(arg)
    with pytest.raises(exc, match=match.replace("pin_", "unpin_")):
        unpin_(arg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_pin_without_cuda_is_a_recorded_no_op():
    t = torch.arange(1000, dtype=torch.float32)
    before = arena_stats()["pin_noops"]
    ptr = t.data_ptr()
    assert pin_(t) is t
    assert t.data_ptr() == ptr and not t.is_pinned() and not is_registered(t)
    assert arena_stats()["pin_noops"] == before + 1
    assert unpin_(t) is t
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32))


@pytest.mark.gpu
def test_gpu_pin_1_gib_in_place(copy_gbps):
    n = GiB // 8
    t = torch.empty(n, dtype=torch.int64)  # [128 Mi] int64 = 1 GiB, pageable
    t.copy_(torch.arange(n, dtype=torch.int64).mul_(2654435761).remainder_(1 << 31))
    ptr = t.data_ptr()
    checksum = int(t[:: 1 << 12].sum())
    before = arena_stats()
    t0 = time.perf_counter()
    assert pin_(t) is t
    seconds = time.perf_counter() - t0
    try:
        assert t.data_ptr() == ptr, "pin_ must not move the data"
        assert t.is_pinned() and is_registered(t)
        assert int(t[:: 1 << 12].sum()) == checksum
        after = arena_stats()
        assert after["pin_calls"] == before["pin_calls"] + 1
        assert after["pinned_in_place_bytes"] == before["pinned_in_place_bytes"] + GiB
        assert pin_(t) is t  # pinning again is a no-op
        assert arena_stats()["pin_calls"] == after["pin_calls"]
        dev = torch.empty(n, dtype=torch.int64, device="cuda")
        gbs = copy_gbps(t, dev, reps=1)  # t is 1 GiB
        assert int(dev[:: 1 << 12].sum()) == checksum
        print(f"\npin_(1 GiB): {seconds:.2f} s in cudaHostRegister; H2D from it {gbs:.1f} GB/s")
        assert gbs >= 40.0, f"H2D from a pin_-ed tensor ran at {gbs:.1f} GB/s: not page-locked speed"
    finally:
        unpin_(t)
    assert not t.is_pinned() and not is_registered(t)
    assert arena_stats()["pinned_in_place_bytes"] == before["pinned_in_place_bytes"]
    with pytest.raises(ArenaError, match="was not pinned by pin_"):
        unpin_(t)


def test_pin_view_needs_one_byte_range():
    t = torch.arange(64, dtype=torch.float32).view(8, 8)
    for fn in (pin_, unpin_):
        with pytest.raises(
            ValueError, match=r"\(view=True\): tensor must be contiguous.*Fix: pass a contiguous"
        ):
            fn(t.t(), view=True)


def _page_locked(t: torch.Tensor) -> bool:
    """What the CUDA driver says of ``t``'s first byte: host memory registered with it (not torch's
    ``is_pinned()``, which looks at the storage's first byte)."""
    cupy = pytest.importorskip("cupy")
    attrs = cupy.cuda.runtime.pointerGetAttributes(t.data_ptr())
    kind = getattr(
        attrs, "type", getattr(attrs, "memoryType", None)
    )  # the field's name differs by CuPy version
    return kind == 1  # cudaMemoryTypeHost (0 is unregistered, pageable memory)


@pytest.mark.gpu
def test_gpu_pin_views_of_one_storage():
    """Two disjoint page runs of one storage registered apart (the gap between them is not touched); a copy
    from inside each is asynchronous and exact; each unpins on its own."""
    page = 4096
    buf = torch.arange(16 * page, dtype=torch.uint8)  # [16 pages] of bytes, pageable
    a, b = buf[0 : 4 * page], buf[8 * page : 12 * page]
    gap = buf[5 * page : 6 * page]
    pin_(a, view=True)
    pin_(b, view=True)
    assert is_registered(a, view=True) and is_registered(b, view=True) and not is_registered(gap, view=True)
    assert _page_locked(a) and _page_locked(b) and not _page_locked(gap)
    got = [x.view(torch.int32).to("cuda", non_blocking=True) for x in (a, b)]
    torch.cuda.synchronize()  # why: the non-blocking copies are done before the results are read
    assert all(torch.equal(g.cpu(), x.view(torch.int32)) for g, x in zip(got, (a, b)))
    unpin_(a, view=True)
    assert not _page_locked(a) and _page_locked(b)
    unpin_(b, view=True)
    assert not _page_locked(b) and not is_registered(b, view=True)
