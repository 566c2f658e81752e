"""copy_rows / rows_of: strided views as evenly spaced rows, copied in one call between host and device."""

import pytest
import torch

from tidal_arena import ArenaConfig, PinnedArena, Rows, copy_rows, rows_of

MiB = 1 << 20


def test_a_token_range_of_a_head_major_buffer_is_one_row_per_head():
    buf = torch.empty(2, 3, 4, 40, 8, dtype=torch.bfloat16)  # [2 (K/V), B, H, T, D]
    assert rows_of(buf[:, :, :, 8:24], lead=3) == Rows(count=24, width=16 * 8 * 2, pitch=40 * 8 * 2)
    # the whole buffer: rows back to back
    assert rows_of(buf, lead=3) == Rows(24, 40 * 8 * 2, 40 * 8 * 2)
    # one row, or none
    assert rows_of(buf[0, 0, 0], lead=0) == Rows(1, 40 * 8 * 2, 40 * 8 * 2)
    # size-1 leading dims (batch 1) do not break the even spacing; one batch row of three does
    one = torch.empty(2, 1, 4, 40, 8, dtype=torch.bfloat16)
    assert rows_of(one[:, :, :, 8:24], lead=3) == Rows(8, 16 * 8 * 2, 40 * 8 * 2)
    with pytest.raises(ValueError, match="not evenly spaced"):
        rows_of(buf[:, :1, :, 8:24], lead=3)


@pytest.mark.parametrize(
    ("view", "lead", "match"),
    [
        (lambda b: b[:, :, :, :, :4], 3, "non-contiguous rows"),  # part of D: a row is not contiguous
        (lambda b: b[:, :, :2], 3, "not evenly spaced"),  # two of four heads: a gap after every second row
        (lambda b: b.transpose(3, 4), 3, "non-contiguous rows"),
        (lambda b: b, 6, "lead=6 is not accepted"),
    ],
)
def test_views_that_are_not_evenly_spaced_rows_are_refused(view, lead, match):
    buf = torch.empty(2, 3, 4, 40, 8)
    with pytest.raises(ValueError, match=match):
        rows_of(view(buf), lead)


def test_copy_rows_on_the_cpu_copies_the_view():
    src = torch.randn(2, 1, 4, 64, 8)
    dst = torch.zeros(2, 1, 4, 96, 8)
    copy_rows(dst[:, :, :, 16:48], src[:, :, :, 32:64], lead=3)
    assert torch.equal(dst[:, :, :, 16:48], src[:, :, :, 32:64])
    assert not dst[:, :, :, :16].any() and not dst[:, :, :, 48:].any()


def test_copy_rows_refuses_mismatched_views():
    with pytest.raises(ValueError, match=r"same shape and dtype.*\(2, 3\).*\(3, 2\)"):
        copy_rows(torch.empty(2, 3), torch.empty(3, 2), lead=1)
    with pytest.raises(ValueError, match="same shape and dtype"):
        copy_rows(torch.empty(2, 3), torch.empty(2, 3, dtype=torch.float16), lead=1)


@pytest.mark.gpu
def test_gpu_copy_rows_moves_strided_pages_both_ways_through_one_call(monkeypatch):
    """Host pages [2, B, H, C·P, D] (pinned) <-> a device slot range [2, B, H, t0:t1, D], bit for bit, on a side stream."""
    import tidal_arena.rows as rows_mod

    calls = []
    runtime = rows_mod.cuda_runtime()
    assert runtime is not None, "CuPy's runtime must be usable on the GPU machine"

    class Counting:
        def __getattr__(self, name):
            return getattr(runtime, name)

        def memcpy2DAsync(self, *args):
            calls.append(args)
            return runtime.memcpy2DAsync(*args)

    monkeypatch.setattr(rows_mod, "_runtime", Counting())
    shape = (2, 2, 8, 1024, 128)  # [2, B, H, C·P, D]
    with PinnedArena(ArenaConfig(backend="cupy", slab_bytes=8 * MiB)) as arena:
        nbytes = 2 * 2 * 8 * 1024 * 128 * 2
        host = arena.alloc(nbytes).tensor(torch.uint8, (nbytes,)).view(torch.bfloat16).view(shape)
        host.copy_(torch.randn(shape, dtype=torch.bfloat16))
        slot = torch.zeros(2, 2, 8, 4096, 128, dtype=torch.bfloat16, device="cuda")
        side = torch.cuda.Stream()
        # why: the slot's zero fill on the compute stream must finish before the side stream writes it
        side.wait_stream(torch.cuda.current_stream())
        copy_rows(slot[:, :, :, 512:1280], host[:, :, :, 256:1024], lead=3, stream=side)
        side.synchronize()  # why: the H2D copy must land before the slot is read
        assert torch.equal(slot[:, :, :, 512:1280].cpu(), host[:, :, :, 256:1024])
        assert not slot[:, :, :, :512].any() and not slot[:, :, :, 1280:].any()
        slot[:, :, :, 512:1280].add_(1)
        back = torch.cuda.Event()
        back.record()  # why: the side stream's D2H copy reads what the compute stream just wrote
        side.wait_event(back)
        copy_rows(host[:, :, :, :768], slot[:, :, :, 512:1280], lead=3, stream=side)
        side.synchronize()  # why: the D2H copy must land before the host pages are read
        assert torch.equal(host[:, :, :, :768], slot[:, :, :, 512:1280].cpu())
    assert len(calls) == 2 and [c[5] for c in calls] == [32, 32]  # 2·B·H rows per call
