"""TokenRange views, the cached current-stream lookup, and the slot placement helpers."""

from __future__ import annotations

import pytest
import torch

from tidal_kv.slots import Slot, pick_slot, prefetch_order
from tidal_kv.stats import KVStats
from tidal_kv.streams import CurrentStream, wait
from tidal_kv.views import KVRange, RowWrites, TailPage, TokenRange
from tidal_testing import devices


@pytest.mark.parametrize("device", devices())
def test_token_range_is_the_slice_view_of_buffers_and_their_unbound_parts(device):
    kv = torch.randn(2, 3, 4, 10, 8, device=device)  # [2, B, H, T, D]
    cases = [(kv, lambda s, e: kv[:, :, :, s:e]), (kv[1], lambda s, e: kv[1][:, :, s:e])]
    for buf, sliced in cases:  # kv[1] starts at a storage offset
        at = TokenRange(buf)
        for start, length in [(0, 10), (3, 1), (9, 1), (0, 0), (4, 5)]:
            view = at(start, length)
            ref = sliced(start, start + length)
            assert view.shape == ref.shape and view.stride() == ref.stride()
            assert view.data_ptr() == ref.data_ptr() or length == 0
            assert torch.equal(view, ref)
    before = kv.clone()
    TokenRange(kv[0])(2, 3).copy_(torch.zeros(3, 4, 3, 8, device=device))  # writes land in the buffer
    assert not kv[0][:, :, 2:5].any()
    before[0][:, :, 2:5] = 0
    assert torch.equal(kv, before)  # and nowhere else


def test_prefetch_order_is_the_next_offloaded_layers_cyclically():
    off = [1, 3, 5, 7]
    assert prefetch_order(0, off, 2) == (1,)  # one slot is left to cool (the last one attention read)
    assert prefetch_order(1, off, 2) == (3,)  # an offloaded layer's own slot stays in use
    assert prefetch_order(7, off, 3) == (1, 3)  # after the last one: the next step's first
    assert prefetch_order(4, [5], 2) == (5,)  # never more than the offloaded layers


def test_pick_slot_prefers_the_owner_then_a_free_slot_then_takes_back_the_oldest_prefetch():
    slots = [Slot(torch.zeros(2, 1, 1, 8, 2)) for _ in range(2)]
    stats = KVStats()
    a = pick_slot(slots, {}, None, layer=3, stats=stats)
    a.pages = 2
    assert pick_slot(slots, {}, None, layer=3, stats=stats) is a and stats.pages_reused == 2
    b = pick_slot(slots, {}, a, layer=5, stats=stats)  # `a` is in use by attention
    assert b is not a and b.owner == 5 and b.pages == 0
    pending = {5: b}
    c = pick_slot(slots, pending, a, layer=7, stats=stats)  # nothing free: layer 5's prefetch is taken back
    assert c is b and pending == {} and c.owner == 7


@pytest.mark.gpu
def test_current_stream_follows_stream_contexts_and_reuses_its_object():
    current = CurrentStream(torch.device("cuda", torch.cuda.current_device()))
    first = current()
    assert first == torch.cuda.current_stream() and current() is first  # same stream: same object
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side
    assert current() == torch.cuda.current_stream()


class _Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_wait_inserts_a_wait_only_for_an_event_still_pending():
    stream, pending, finished = _Stream(), _Event(False), _Event(True)
    wait(stream, finished)  # a completed event orders nothing: no wait is inserted
    wait(stream, None)
    wait(None, pending)  # the CPU: no streams
    assert stream.waited == []
    wait(stream, pending)
    assert stream.waited == [pending]


@pytest.mark.gpu
def test_wait_orders_work_behind_an_unfinished_event_and_skips_a_finished_one():
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    compute.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # why: keep the side stream busy so the event is still pending
        x.fill_(1.0)
        ev = torch.cuda.Event()
        ev.record(side)
    assert not ev.query()
    wait(compute, ev)  # pending: the compute stream must wait for the fill
    assert bool((x.clone() == 1.0).all())
    ev.synchronize()
    wait(compute, ev)  # finished: nothing to wait for
    assert bool((x == 1.0).all())


def test_row_writes_are_left_to_copy_on_the_cpu():
    assert RowWrites.of(torch.zeros(1, 2, 8, 4)) is None
    tail = TailPage(torch.zeros(2, 1, 2, 8, 4))
    k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    tail.write(3, k, v)
    assert torch.equal(tail.buf[0][:, :, 3:4], k) and torch.equal(tail.buf[1][:, :, 3:4], v)
    assert not tail.buf[:, :, :, [0, 1, 2, 4, 5, 6, 7]].any()


def _sources(b: int, h: int, d: int) -> dict[str, torch.Tensor]:
    """[B, H, 1, D] one-token sources laid out as models make them: evenly spaced rows, except a slice of a fused
    projection with B > 1 and H > 1 (heads D apart, batches 3·H·D apart)."""
    proj = torch.randn(b, 1, h * d, device="cuda", dtype=torch.bfloat16)
    fused = torch.randn(b, 1, 3 * h * d, device="cuda", dtype=torch.bfloat16)  # q, k, v in one projection
    return {
        "contiguous": torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16),
        "transposed": proj.view(b, 1, h, d).transpose(1, 2),  # [B, 1, H, D] -> [B, H, 1, D]
        "fused": fused[:, :, h * d : 2 * h * d].view(b, 1, h, d).transpose(1, 2),
        "wide": torch.randn(b, h, 1, 2 * d, device="cuda", dtype=torch.bfloat16)[..., :d],  # rows 2·D apart
    }


@pytest.mark.gpu
@pytest.mark.parametrize("b,h", [(1, 8), (3, 4), (2, 1), (1, 1)])
def test_gpu_token_writes_land_exactly_where_copy_puts_them(b, h):
    d, cap = 128, 40
    for name, src in _sources(b, h, d).items():
        k_buf, v_buf = (torch.randn(b, h, cap, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref_k, ref_v = k_buf.clone(), v_buf.clone()
        at = KVRange(k_buf, v_buf)
        assert at._k_rows is not None  # the memcpy path is what this test checks
        v_src = src * 2
        issued = at.write_token(17, src, v_src)
        assert issued == (name != "fused" or b == 1 or h == 1), name
        if not issued:
            at.write(17, src, v_src)  # the caller's copy
        ref_k[:, :, 17:18] = src
        ref_v[:, :, 17:18] = v_src
        torch.cuda.synchronize()
        assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v), name


@pytest.mark.gpu
def test_gpu_tail_page_writes_and_slot_page_copies_match_copy():
    b, h, p, d, cap = 2, 4, 16, 64, 64
    tail = TailPage(torch.zeros(2, b, h, p, d, device="cuda", dtype=torch.bfloat16))
    k, v = (torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    tail.write(5, k, v)
    slot = Slot(torch.randn(2, b, h, cap, d, device="cuda", dtype=torch.bfloat16))
    assert slot._rows is not None
    ref = slot.kv.clone()
    slot.copy_page(2, p, tail.buf)
    ref[:, :, :, 2 * p : 3 * p] = tail.buf
    torch.cuda.synchronize()
    assert torch.equal(tail.buf[0][:, :, 5:6], k) and torch.equal(tail.buf[1][:, :, 5:6], v)
    assert torch.count_nonzero(tail.buf) == 2 * b * h * d  # nothing else was written
    assert torch.equal(slot.kv, ref)


@pytest.mark.gpu
def test_gpu_token_writes_follow_the_current_stream():
    side = torch.cuda.Stream()
    buf = torch.zeros(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    at = KVRange(buf, torch.zeros_like(buf))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # why: the source is made late on the side stream
        src = torch.ones(1, 2, 1, 64, device="cuda", dtype=torch.bfloat16)
        assert at.write_token(3, src, src)  # queued behind the sleep and the fill, on the side stream
    side.synchronize()
    assert bool((buf[:, :, 3] == 1).all()) and int(torch.count_nonzero(buf)) == 2 * 64
